"""Token drop's knobs (:class:`TokenDropConfig`, stored under ``plan.knobs["token_drop"]``), the rule
that resolves ``drop_layers`` and the command-line form of its knobs; the method's declaration is
this folder's ``__init__.py``. Each knob is described once, in its field's metadata (:func:`knob`).

    --token-drop                                     the defaults (p=0.99,obs_window=128,block_size=64,
                                                     num_sink=128,min_prompt_len=8192,drop_layers=auto,
                                                     drop_point=after_attention,reenter=false,spare_anchors=0)
    --token-drop drop_layers=5:8:11,reenter=true     layer lists joined by ':' (commas split knobs)
    --token-drop p=0.98,block_size=32                some knobs changed
    --token-drop off | on                            (at load) off, or as built / the defaults

    >>> parse_token_drop("p=0.98,block_size=32").block_size
    32
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from infhip.methods.method import NOT_MEASURED, knob, require


# Short names the token-drop knobs once had besides their field names: naming one is an error
# that gives the field name (old command lines get a helpful message).
RENAMED_TOKEN_DROP_KNOBS = {"n": "obs_window", "G": "block_size", "g": "block_size", "A": "num_sink",
                            "a": "num_sink", "min_len": "min_prompt_len", "spare": "spare_anchors"}
# retention (rho): a fixed share of blocks kept instead of top-p, a benchmark setting; no longer
# in the engine format (engines that name it load without it).
REMOVED_TOKEN_DROP_KNOBS = frozenset({"retention"})
RETENTION_MOVED = ("retention (rho) is not a token-drop knob any more: it is a benchmark setting "
                   "(infhip-eval --retention RHO; in Python infhip.eval.common.set_forced_retention(llm, rho))")


DROP_POINTS = ("before_attention", "after_attention")
DROP_LAYER_RULES = ("auto", "every")
# drop_layers="auto" is a depth rule: for each k here, the first full-attention layer ending the
# k-th eighth of the depth. The authors' configured lists (UniPrefill's vLLM fork) are k = 5..7 on
# Gemma-3-12B (29, 35, 41 of 48) and k = 2..7 on Llama-3.1-8B (7, 11, ..., 27 of 32). On
# Qwen2.5-Coder-0.5B RULER at 8K/16K/32K (H200, 45 prompts per length, p = 0.99; docs/quality.md)
# k = 2..7 lost 25 / 30 / 18 points to dense, k = 4..7 1.1 / 2.8 / 0.8 and k = 6..7 0.8 / 1.7 / -0.2:
# the early drops lose the needles. The default is the measured k = 6..7 (within 2 points at each length).
AUTO_DEPTH_EIGHTHS = (6, 7)
AUTHORS_LLAMA_EIGHTHS = (2, 3, 4, 5, 6, 7)  # the authors' Llama-3.1-8B list (parity harness)


def default_drop_layers(full_layers: list[int], num_layers: int,
                        eighths: tuple[int, ...] = AUTO_DEPTH_EIGHTHS) -> tuple[int, ...]:
    """drop_layers="auto": for k in ``eighths``, the first full-attention layer l with
    (l + 1) >= k * L / 8 (L = num_layers). With the default k = 6..7: on Qwen2.5-0.5B (24
    layers) 17, 20 (measured on RULER, docs/quality.md); on Llama-3.1-8B 23, 27; on Gemma-3-12B
    35, 41 (the authors' list there is 29, 35, 41: k = 5..7). ``AUTHORS_LLAMA_EIGHTHS`` gives their Llama list.

    >>> default_drop_layers(list(range(32)), 32)
    (23, 27)
    >>> default_drop_layers(list(range(32)), 32, AUTHORS_LLAMA_EIGHTHS)
    (7, 11, 15, 19, 23, 27)
    >>> default_drop_layers(list(range(5, 48, 6)), 48, (5, 6, 7))  # the authors' Gemma-3-12B list
    (29, 35, 41)
    """
    out = []
    for k in eighths:
        l = next((f for f in sorted(full_layers) if 8 * (f + 1) >= k * num_layers), None)
        if l is not None and l not in out:
            out.append(l)
    return tuple(out)


def resolve_drop_layers(cfg: "TokenDropConfig", full_layers: list[int], num_layers: int) -> tuple[int, ...]:
    """The layers (ascending) at which a prefill pass drops tokens under ``cfg``, without the
    first ``spare_anchors`` of them. ValueError when an explicit list names a layer that is not
    a full-attention layer of the model."""
    if cfg.drop_layers == "every":
        layers = tuple(sorted(full_layers))
    elif cfg.drop_layers == "auto":
        layers = default_drop_layers(full_layers, num_layers)
    else:
        bad = sorted(set(cfg.drop_layers) - set(full_layers))
        require(not bad, f"token_drop drop_layers names {bad}, which are not full-attention layers of this "
               f"model; drops happen at full-attention layers: {sorted(full_layers)}")
        layers = tuple(sorted(cfg.drop_layers))
    return layers[cfg.spare_anchors:]


def parse_drop_layers(value: Any) -> str | tuple[int, ...]:
    """drop_layers as given (API, config.json, command line): "auto", "every", a list of layer
    indices, or on a command line indices joined by ':' ("5:8:11") -> "auto" | "every" | tuple."""
    if isinstance(value, str):
        v = value.strip().lower()
        if v in DROP_LAYER_RULES:
            return v
        try:
            value = [int(x) for x in v.replace(":", " ").split()]
        except ValueError:
            raise ValueError(f"token_drop drop_layers must be 'auto', 'every' or layer indices (a list, or "
                             f"'5:8:11' on a command line), got {value!r}") from None
    require(isinstance(value, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                                    for x in value),
           f"token_drop drop_layers must be 'auto', 'every' or a list of layer indices >= 0, got {value!r}")
    require(len(value) > 0, "token_drop drop_layers is empty: turn token drop off instead (--token-drop off)")
    return tuple(sorted(set(value)))


_PARITY = ("[H200 RULER](quality.md#uniprefill-on-the-h200-ruler-at-8k32k-and-the-drop-schedule), "
           "[parity table](quality.md#uniprefill-parity-with-the-authors-code)")


@dataclass(frozen=True)
class TokenDropConfig:
    """UniPrefill token dropping in prefill (paper 004; infhip/methods/token_drop/runtime/step.py).

    At each *drop layer* (``drop_layers``: full-attention layers) of a prefill pass, the pass's
    last ``obs_window`` queries score blocks of ``block_size`` of its current tokens; the smallest
    set of blocks holding fraction ``p`` of the attention mass is kept, plus the first
    ``num_sink`` tokens and the pass's last ``obs_window`` tokens (more on models with sliding
    layers: see infhip/methods/token_drop/runtime/step.py). ``drop_point`` says whether the drop layer's own
    attention runs over all current tokens first (``after_attention``, the authors' code) or
    over the kept ones only (``before_attention``, the paper's Eq. 8). With ``reenter`` the
    dropped tokens come back at the next drop layer with their saved stream (the paper's
    reconstitution); without it the kept set only shrinks (the authors' code). The defaults are
    the authors' code (after attention, no re-entry) at the layers ending 6/8 and 7/8 of the
    depth: on Qwen2.5-0.5B RULER their Llama list (from 2/8)
    lost 18-30 points to dense, drops from half depth on 0.8-2.8 (docs/quality.md).
    A prompt shorter than ``min_prompt_len`` is never dropped: below ~8K tokens prefill is short
    already, the estimate costs a few percent (paper: -5% at 4K on hybrids), and any drop can
    only lose quality. Every knob may be changed per load (``LLM(..., token_drop={...})``).
    """

    p: float = knob(0.99, "the smallest set of token blocks holding this share of the attention mass is kept",
                    runtime=True, measured="Gemma-3-270M 4K, spare_anchors 1: p = 0.99 −0.03 %, p = 0.98 +0.19 % "
                    "perplexity ([quality](quality.md#the-earlier-schedule-perplexity-on-smollm2-and-gemma-3))")
    obs_window: int = knob(128, "last queries of the chunk that score the blocks", runtime=True, measured=NOT_MEASURED)
    block_size: int = knob(64, "tokens per scored block", runtime=True, measured=NOT_MEASURED)
    num_sink: int = knob(128, "first tokens always kept", runtime=True, measured=NOT_MEASURED)
    min_prompt_len: int = knob(
        8192, "shorter prompts never drop", runtime=True,
        measured="overhead with every block kept, Llama-8B: 21 % at 8K, 4.8 % at 32K, 2.6 % at 128K "
        "([benchmarks](benchmarks.md#token-drop-uniprefill-ttft-vs-dense))")
    drop_layers: Any = knob(
        "auto", "layers that drop: 'auto' (the full-attention layers ending the 6th and 7th eighth of the "
        "depth: on Qwen2.5-0.5B RULER within 2 points of dense where the authors' Llama list lost 18-30), 'every' (every full-attention layer), or layer "
        "indices (a list; '5:8:11' on a command line); engines built before it: 'every'", runtime=True,
        measured=_PARITY)
    drop_point: str = knob(
        "after_attention", "'after_attention': the drop layer's attention runs over all current tokens, its "
        "MLP and later layers over the kept ones (the authors' code); 'before_attention': its attention too "
        "runs over the kept ones (the paper's Eq. 8); engines built before it: 'before_attention'",
        runtime=True, measured=_PARITY)
    reenter: bool = knob(
        False, "dropped tokens re-enter at the next drop layer with their saved stream (the paper's "
        "reconstitution); False: the kept set only shrinks (the authors' code); engines built before it: "
        "True", runtime=True, measured=_PARITY)
    spare_anchors: int = knob(
        0, "the first N drop layers keep every token (they still score); engines built before drop_layers: "
        "their stored value (0 before the knob existed)", runtime=True,
        measured="with drop_layers='every': Gemma-3-270M p = 0.99: perplexity ×10.8 → −0.03 % at 4K; SmolLM2 "
        "×6.8 → +30 % ([quality](quality.md#the-earlier-schedule-perplexity-on-smollm2-and-gemma-3)); "
        "not measured with 'auto'")

    def __post_init__(self) -> None:
        require(0.0 < self.p <= 1.0, f"token_drop p must be in (0, 1], got {self.p}")
        for name in ("obs_window", "block_size"):
            v = getattr(self, name)
            require(isinstance(v, int) and v >= 1, f"token_drop {name} must be an int >= 1, got {v!r}")
        for name in ("num_sink", "min_prompt_len", "spare_anchors"):
            v = getattr(self, name)
            require(isinstance(v, int) and v >= 0, f"token_drop {name} must be an int >= 0, got {v!r}")
        object.__setattr__(self, "drop_layers", parse_drop_layers(self.drop_layers))
        require(self.drop_point in DROP_POINTS,
               f"token_drop drop_point must be one of {', '.join(DROP_POINTS)}, got {self.drop_point!r}")
        require(isinstance(self.reenter, bool), f"token_drop reenter must be true or false, got {self.reenter!r}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TokenDropConfig":
        # engines written before spare_anchors existed dropped at every anchor, and before
        # drop_layers every full-attention layer was an anchor (drop before its attention, the
        # dropped rows re-entering at the next): keep them so
        d = {k: v for k, v in d.items() if k not in REMOVED_TOKEN_DROP_KNOBS}
        if "drop_layers" not in d:
            d = {"spare_anchors": 0, "drop_layers": "every", "drop_point": "before_attention", "reenter": True, **d}
        return cls(**d)

    def replace(self, **overrides: Any) -> "TokenDropConfig":
        check_token_drop_keys(overrides)
        return dataclasses.replace(self, **overrides)


def check_token_drop_keys(names) -> None:
    """ValueError for a name that is not a token-drop knob; an old short name gets its field name."""
    fields = [f.name for f in dataclasses.fields(TokenDropConfig)]
    for name in names:
        if name in RENAMED_TOKEN_DROP_KNOBS:
            raise ValueError(f"token_drop knob {name!r} is now called {RENAMED_TOKEN_DROP_KNOBS[name]!r} "
                             f"(one name per knob: {', '.join(fields)})")
        if name in ("rho",) or name in REMOVED_TOKEN_DROP_KNOBS:
            raise ValueError(RETENTION_MOVED)
    unknown = sorted(set(names) - set(fields))
    require(not unknown, f"unknown token_drop knob(s): {', '.join(unknown)}; known: {', '.join(fields)}")


_FLOATS = ("p",)
_STRINGS = ("drop_layers", "drop_point")  # parsed by TokenDropConfig (drop_layers: auto | every | 5:8:11)
_BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def parse_token_drop_knobs(text: str) -> dict[str, Any]:
    """``key=value,...`` -> {field name: typed value} of the given keys only (to lay over an
    engine's own knobs: ``LLM(..., token_drop=knobs)``). Raises ValueError with a one-line fix;
    an old short key (G, n, A, min_len, spare, rho) gets the name to use instead."""
    knobs: dict[str, Any] = {}
    names = [f.name for f in dataclasses.fields(TokenDropConfig)]
    keys = ", ".join(names)
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not value:
            raise ValueError(f"--token-drop item {item!r} is not key=value (keys: {keys}), "
                             "e.g. --token-drop p=0.98,block_size=32")
        if key in RENAMED_TOKEN_DROP_KNOBS:
            new = RENAMED_TOKEN_DROP_KNOBS[key]
            raise ValueError(f"--token-drop: key {key!r} is now called {new!r}: --token-drop {new}={value}")
        if key in ("rho", "retention"):
            raise ValueError(f"--token-drop: {RETENTION_MOVED}")
        if key not in names:
            raise ValueError(f"--token-drop: unknown key {key!r}; keys: {keys}")
        if key in knobs:
            raise ValueError(f"--token-drop: {key!r} given twice")
        if key in _STRINGS:
            knobs[key] = value
            continue
        if key == "reenter":
            if value.lower() not in _BOOLS:
                raise ValueError(f"--token-drop: reenter={value!r} must be true or false")
            knobs[key] = _BOOLS[value.lower()]
            continue
        try:
            knobs[key] = float(value) if key in _FLOATS else int(value)
        except ValueError:
            kind = "a number" if key in _FLOATS else "an integer"
            raise ValueError(f"--token-drop: {key}={value!r} must be {kind}") from None
    TokenDropConfig(**knobs)  # range checks, one line each
    return knobs


def parse_token_drop(text: str) -> TokenDropConfig:
    """``key=value,...`` (empty: the defaults) -> its TokenDropConfig; ValueError with a one-line fix."""
    return TokenDropConfig(**parse_token_drop_knobs(text))


__all__ = ["AUTHORS_LLAMA_EIGHTHS", "DROP_POINTS", "RENAMED_TOKEN_DROP_KNOBS", "TokenDropConfig",
           "check_token_drop_keys", "default_drop_layers", "parse_token_drop", "parse_token_drop_knobs",
           "resolve_drop_layers"]
