"""SamplingParams validation and the Sampler (CPU)."""

import doctest

import pytest
import torch

import infhip.runtime.sampling_params as sampling_params_module
from infhip.runtime.sampler import Sampler, make_generator
from infhip.runtime.sampling_params import SamplingParams

V = 50


def test_docstring_example_runs():
    assert doctest.testmod(sampling_params_module).failed == 0


def test_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k) == (16, 1.0, 1.0, 0)
    assert p.stop == [] and p.stop_token_ids == [] and not p.greedy
    p = SamplingParams(stop="END", stop_token_ids=(3, 4), temperature=0)
    assert p.stop == ["END"] and p.stop_token_ids == [3, 4] and p.greedy
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(top_k=-1).top_k == -1


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=0), "SamplingParams.max_tokens must be an int >= 1, got 0"),
    (dict(max_tokens=2.0), "SamplingParams.max_tokens must be an int >= 1, got 2.0"),
    (dict(temperature=-0.1), "SamplingParams.temperature must be a finite number >= 0"),
    (dict(temperature=float("nan")), "SamplingParams.temperature must be a finite number"),
    (dict(temperature=float("inf")), "SamplingParams.temperature must be a finite number"),
    (dict(top_p=1.5), "SamplingParams.top_p must be in (0, 1], got 1.5"),
    (dict(top_p=0), "SamplingParams.top_p must be in (0, 1], got 0"),
    (dict(top_k=-2), "SamplingParams.top_k must be an int >= 1, or 0 / -1 for off, got -2"),
    (dict(top_k=2.5), "SamplingParams.top_k must be an int"),
    (dict(top_k=True), "SamplingParams.top_k must be an int"),
    (dict(stop=""), "SamplingParams.stop must be non-empty strings"),
    (dict(stop=["ok", ""]), "SamplingParams.stop must be non-empty strings"),
    (dict(stop=[1]), "SamplingParams.stop must be a string or a list of strings"),
    (dict(stop_token_ids=[1, "2"]), "SamplingParams.stop_token_ids must be a list of token ids"),
    (dict(stop_token_ids=[-1]), "SamplingParams.stop_token_ids must be a list of token ids"),
    (dict(seed=1.5), "SamplingParams.seed must be an int or None, of 64 bits: in [-2**63, 2**64), got 1.5"),
    (dict(seed=2**64), "SamplingParams.seed must be an int or None, of 64 bits"),
    (dict(seed=-2**63 - 1), "SamplingParams.seed must be an int or None, of 64 bits"),
    (dict(ignore_eos=1), "SamplingParams.ignore_eos must be a bool"),
])
def test_validation_messages(kwargs, message):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert str(e.value).startswith(message), str(e.value)


def _logits(b=4, v=V, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, v, generator=g) * 3).to(dtype)


def test_greedy_is_argmax_any_dtype():
    sampler = Sampler()
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = _logits(8, dtype=dtype)
        out = sampler(x, [SamplingParams(temperature=0)] * 8, [None] * 8)
        assert out.dtype == torch.int64 and out.shape == (8,)
        assert torch.equal(out, x.argmax(-1))
    x = torch.zeros(2, V)  # ties: lowest index
    assert sampler(x, [SamplingParams(temperature=0)] * 2, [None] * 2).tolist() == [0, 0]


def test_top_k_1_and_tiny_top_p_are_greedy():
    sampler = Sampler()
    x = _logits(16)
    want = x.argmax(-1)
    for p in (SamplingParams(top_k=1), SamplingParams(top_p=1e-9), SamplingParams(temperature=5.0, top_k=1)):
        for seed in range(3):
            gens = [make_generator(seed * 100 + i, "cpu") for i in range(16)]
            assert torch.equal(sampler(x, [p] * 16, gens), want)
    x = torch.zeros(1, V)  # ties under top_k=1: the lowest index, like argmax
    assert sampler(x, [SamplingParams(top_k=1)], [None]).tolist() == [0]


def test_seeded_sampling_reproducible_and_seeds_differ():
    sampler = Sampler()
    x = torch.zeros(1, V)  # uniform: seeds must make the difference

    def draws(seed, n=30):
        g = make_generator(seed, "cpu")
        return [sampler(x, [SamplingParams(seed=seed)], [g]).item() for _ in range(n)]

    assert draws(1) == draws(1)
    assert draws(1) != draws(2)
    assert make_generator(None, "cpu") is None


def test_row_in_batch_equals_row_alone():
    # Vectorising across rows must not change what a seeded row samples.
    sampler = Sampler()
    x = _logits(6)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, seed=1),
              SamplingParams(top_k=5, seed=2), SamplingParams(top_p=0.8, seed=3),
              SamplingParams(temperature=1.3, top_k=10, top_p=0.9, seed=4),
              SamplingParams(temperature=0)]
    batch = sampler(x, params, [make_generator(p.seed, "cpu") for p in params])
    for i, p in enumerate(params):
        alone = sampler(x[i:i + 1], [p], [make_generator(p.seed, "cpu")])
        assert alone.item() == batch[i].item(), i


def test_top_k_never_outside_allowed_set():
    torch.manual_seed(0)  # rows without a generator use the global RNG
    sampler = Sampler()
    n = 4000
    row = _logits(1, seed=7)[0]
    x = row.expand(n, V).contiguous()
    allowed = set(torch.topk(row, 5).indices.tolist())
    out = sampler(x, [SamplingParams(top_k=5, temperature=2.0)] * n, [None] * n)
    seen = set(out.tolist())
    assert seen <= allowed and len(seen) >= 4  # all 5 are likely with T=2


def test_top_p_never_outside_nucleus_and_frequencies():
    torch.manual_seed(0)
    sampler = Sampler()
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    x = probs.log().expand(20000, 5).contiguous()
    # top_p=0.65: mass above token 1 is 0.4 < 0.65, above token 2 0.7 >= 0.65: nucleus {0, 1}.
    g = make_generator(0, "cpu")
    out = torch.cat([sampler(x[i:i + 1], [SamplingParams(top_p=0.65)], [g]) for i in range(2000)])
    assert set(out.tolist()) == {0, 1}
    # Unfiltered batch: frequencies follow the distribution.
    out = sampler(x, [SamplingParams()] * 20000, [None] * 20000)
    freq = torch.bincount(out, minlength=5).float() / 20000
    assert torch.allclose(freq, probs, atol=0.02), freq
    # Temperature 0.5 squares the probabilities (then renormalises).
    out = sampler(x, [SamplingParams(temperature=0.5)] * 20000, [None] * 20000)
    freq = torch.bincount(out, minlength=5).float() / 20000
    assert torch.allclose(freq, probs ** 2 / (probs ** 2).sum(), atol=0.02), freq
    # top_k=3 + top_p=0.9 over the renormalised top 3 (0.4, 0.3, 0.15)/0.85: all three stay.
    out = sampler(x, [SamplingParams(top_k=3, top_p=0.9)] * 20000, [None] * 20000)
    assert set(out.tolist()) == {0, 1, 2}


def test_sampler_shape_errors():
    with pytest.raises(ValueError, match="one of each per row"):
        Sampler()(torch.zeros(2, V), [SamplingParams()], [None, None])
