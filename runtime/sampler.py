"""Token sampling from the last-position logits of a batch: greedy, temperature, top-k, top-p.

Rows are independent; each random row uses its own ``torch.Generator`` (seeded requests are
reproducible whatever else is in the batch) or the global RNG when it has none. Work is
vectorised across rows: all greedy rows take one argmax, all random rows one sort / softmax /
argmax; only the per-row noise draw loops over rows (one generator each).

Sampling is an exponential race: argmax_i(p_i / q_i) with q_i ~ Exp(1) picks i with probability
p_i (the index of the smallest of independent Exp(p_i) variables), and tokens filtered out
(p_i = 0) can never win.
"""

from __future__ import annotations

import torch

from infhip.runtime.sampling_params import SamplingParams

# Temperatures below this are treated as greedy: logits / T would overflow float32 (and the
# distribution is one-hot in float32 anyway for any real logit gap).
_MIN_TEMPERATURE = 1e-5


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A generator on ``device`` seeded with ``seed``, or None (use the global RNG)."""
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def _filter_top_k_top_p(x: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Set to -inf the logits each row does not keep. x: [R, V] float32 (already / temperature);
    top_k: per row, <= 0 = off; top_p: per row in (0, 1]."""
    r, v = x.shape
    # Stable descending sort: among equal logits the lower index ranks first (like argmax).
    sorted_x, order = torch.sort(x, dim=-1, descending=True, stable=True)
    rank = torch.arange(v, device=x.device)
    k = torch.tensor([kk if 0 < kk < v else v for kk in top_k], device=x.device)
    sorted_x = sorted_x.masked_fill(rank[None, :] >= k[:, None], float("-inf"))
    if any(p < 1.0 for p in top_p):
        # Nucleus over the top-k survivors: keep token i iff the mass of the tokens ranked above
        # it is < top_p. Rank 0 has mass 0 above it, so at least one token always stays.
        probs = torch.softmax(sorted_x, dim=-1)
        mass_above = torch.cumsum(probs, dim=-1) - probs
        p = torch.tensor(top_p, dtype=torch.float32, device=x.device)
        drop = (mass_above >= p[:, None]) & (p[:, None] < 1.0)
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.full_like(x, float("-inf")).scatter_(-1, order, sorted_x)


class Sampler:
    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> torch.Tensor:
        """logits [B, V] (any float dtype) -> token ids [B] int64, on logits.device."""
        if logits.dim() != 2:
            raise ValueError(f"Sampler: logits must be [batch, vocab], got shape {tuple(logits.shape)}")
        b, v = logits.shape
        if len(params) != b or len(generators) != b:
            raise ValueError(f"Sampler: {b} logit rows but {len(params)} params and "
                             f"{len(generators)} generators; give one of each per row")
        out = torch.empty(b, dtype=torch.int64, device=logits.device)
        greedy = [i for i, p in enumerate(params) if p.temperature < _MIN_TEMPERATURE]
        rand = [i for i, p in enumerate(params) if p.temperature >= _MIN_TEMPERATURE]
        if len(greedy) == b:
            return logits.argmax(dim=-1)
        if greedy:
            idx = torch.tensor(greedy, device=logits.device)
            out[idx] = logits[idx].argmax(dim=-1)

        idx = torch.tensor(rand, device=logits.device)
        ps = [params[i] for i in rand]
        temp = torch.tensor([p.temperature for p in ps], dtype=torch.float32, device=logits.device)
        x = logits[idx].float() / temp[:, None]
        if any(0 < p.top_k < v or p.top_p < 1.0 for p in ps):
            x = _filter_top_k_top_p(x, [p.top_k for p in ps], [p.top_p for p in ps])
        probs = torch.softmax(x, dim=-1)

        # Exp(1) noise: rows with their own generator draw from it, the rest in one batch.
        q = torch.empty_like(probs)
        no_gen = [j for j, i in enumerate(rand) if generators[i] is None]
        if len(no_gen) == len(rand):
            q.exponential_()
        else:
            for j, i in enumerate(rand):
                if generators[i] is not None:
                    q[j].exponential_(generator=generators[i])
            if no_gen:
                rows = torch.tensor(no_gen, device=logits.device)
                q[rows] = torch.empty(len(no_gen), v, device=logits.device).exponential_()
        # q == 0 is possible in principle; a zero would make 0/0 = NaN win argmax.
        out[idx] = (probs / q.clamp_min_(1e-30)).argmax(dim=-1)
        return out
