"""Token sampling from the last-position logits of a batch, on the device, batched.

A step builds one `SamplingBatch` on the host (`SamplingBatch.build`: the rows' parameters as
device tensors, and for rows with penalties their token counts); `Sampler.sample(logits, batch)`
then only launches kernels: no host sync, no host-to-device copy, so a run of back-to-back
decode steps (EngineCore._decode_steps, after each CUDA-graph replay: the graphs end at the logits,
sampling is outside them) calls it once per step and the batch's device state (output counts,
output lengths) advances on the device with the sampled tokens.

What happens to a row's logits, in this order (vLLM's order); each stage runs only when some
row of the batch uses it, so a batch of plain requests pays for none of them:
  0. logprobs: the raw model log-softmax (before everything below), the chosen token's
     logprob, its rank and the top-k, for the rows with `logprobs` set (or best_of > n);
  1. token bitmask: ``batch.token_bitmask`` [B, ceil(V / 32)] int32, bit t % 32 of word t // 32
     set = token t allowed (xgrammar's layout; `apply_token_bitmask`). THE place for
     structured output: whoever constrains a row fills its bitmask row (all bits set = free)
     before `sample`, and sets ``batch.host_each_step`` (a grammar advances on the host after
     every token, so the engine then runs one decode step at a time);
  2. bad words: single tokens always; a multi-token word bans its last token where the output
     ends with the others (matched on the host at build: ``host_each_step``);
  3. min_tokens: EOS (unless ignore_eos) and stop_token_ids get -inf while the output is shorter;
  4. logit_bias added;
  5. repetition_penalty (prompt and output tokens), frequency and presence penalties (output);
  6. greedy rows (temperature 0) take the argmax here; the others: / temperature, min_p,
     top-k, top-p, then one draw.

Rows are independent; each random row uses its own ``torch.Generator`` (seeded requests are
reproducible whatever else is in the batch) or the global RNG when it has none. Only the
per-row noise draw loops over rows (one generator each).

Sampling is an exponential race: argmax_i(p_i / q_i) with q_i ~ Exp(1) picks i with probability
p_i (the index of the smallest of independent Exp(p_i) variables), and tokens filtered out
(p_i = 0) can never win.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from infhip.runtime.sampling_params import SamplingParams

# Temperatures below this are treated as greedy: logits / T would overflow float32 (and the
# distribution is one-hot in float32 anyway for any real logit gap).
_MIN_TEMPERATURE = 1e-5
_NEG_INF = float("-inf")


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A generator on ``device`` seeded with ``seed``, or None (use the global RNG)."""
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def apply_token_bitmask(x: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """x [B, V] float with -inf where ``bitmask`` [B, ceil(V / 32)] int32 has the token's bit
    clear (in place; returns x)."""
    b, v = x.shape
    if bitmask.shape != (b, (v + 31) // 32):
        raise ValueError(f"token bitmask must be [{b}, {(v + 31) // 32}] for logits {tuple(x.shape)}, "
                         f"got {tuple(bitmask.shape)}")
    bits = torch.arange(32, device=x.device, dtype=torch.int32)
    allowed = ((bitmask.to(torch.int32)[:, :, None] >> bits) & 1).bool().reshape(b, -1)[:, :v]
    return x.masked_fill_(~allowed, _NEG_INF)


@dataclass
class SamplerOutput:
    """tokens [B] int64; for the rows ``logprob_rows`` (host list, batch order): the chosen
    token's raw logprob [R] float32 and rank [R] int64 (1 = most likely), the top
    ``top_ids`` / ``top_logprobs`` [R, K] (K = the largest logprobs asked in the batch; a row
    asking fewer reads its first ones). All on the device until the caller reads them."""

    tokens: torch.Tensor
    logprob_rows: list[int]
    logprobs: torch.Tensor | None = None
    ranks: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


class SamplingBatch:
    """One step's rows as the sampler needs them; built on the host once per step (and kept
    across back-to-back decode steps, whose tokens `Sampler.sample` folds into the counts).

    histories: per row (prompt token ids, output token ids so far), for penalties, min_tokens and
    bad words; None = empty (a row with none of those features needs none).
    eos_token_ids: the model's EOS tokens (min_tokens holds them back unless ignore_eos)."""

    def __init__(self, params: Seq[SamplingParams], generators: Seq[torch.Generator | None],
                 device: torch.device | str, vocab_size: int,
                 histories: Seq[tuple[list[int], list[int]]] | None = None,
                 eos_token_ids: Seq[int] = ()):
        b = len(params)
        if len(generators) != b or (histories is not None and len(histories) != b):
            raise ValueError(f"SamplingBatch: {b} params but {len(generators)} generators and "
                             f"{'no' if histories is None else len(histories)} histories; give one of each per row")
        self.params, self.generators, self.size, self.vocab_size = list(params), list(generators), b, vocab_size
        self.device = torch.device(device)
        hist = list(histories) if histories is not None else [([], [])] * b

        def t(values, dtype=torch.float32):
            return torch.tensor(values, dtype=dtype, device=self.device)

        self.greedy = [i for i, p in enumerate(params) if p.temperature < _MIN_TEMPERATURE]
        self.rand = [i for i, p in enumerate(params) if p.temperature >= _MIN_TEMPERATURE]
        rp = [params[i] for i in self.rand]
        # (a plain all-greedy batch makes no device tensor at all: nothing to copy, nothing to launch)
        self.rand_idx = t(self.rand, torch.int64) if self.rand else None
        self.greedy_idx = t(self.greedy, torch.int64) if self.greedy and self.rand else None
        self.temp = t([p.temperature for p in rp])[:, None] if self.rand else None
        self.min_p = t([p.min_p for p in rp])[:, None] if any(p.min_p > 0 for p in rp) else None
        self.top_k = self.top_p = None
        if any(0 < p.top_k < vocab_size or p.top_p < 1.0 for p in rp):
            self.top_k = t([p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in rp], torch.int64)[:, None]
            self.top_p = t([p.top_p for p in rp])[:, None]
        self.rand_gens = [self.generators[i] for i in self.rand]
        no_gen = [j for j, g in enumerate(self.rand_gens) if g is None]
        self.no_gen_idx = t(no_gen, torch.int64) if 0 < len(no_gen) < len(rp) else None

        # 0. logprobs
        self.logprob_rows = [i for i, p in enumerate(params) if p.needs_logprobs]
        self.logprob_idx = t(self.logprob_rows, torch.int64) if self.logprob_rows else None
        self.top_k_logprobs = max([p.logprobs or 0 for p in params], default=0)

        # 1. structured output fills these (see the module docstring)
        self.token_bitmask: torch.Tensor | None = None
        self.host_each_step = False

        # 2. bad words: (row, token) pairs banned this step
        ban_r, ban_t = [], []
        for i, (p, (_, out)) in enumerate(zip(params, hist)):
            for q in p.bad_words_token_ids or ():
                if len(q) > 1:
                    self.host_each_step = True
                if len(q) == 1 or (len(out) >= len(q) - 1 and out[len(out) - len(q) + 1:] == q[:-1]):
                    ban_r.append(i)
                    ban_t.append(q[-1])
        self.banned = (t(ban_r, torch.int64), t(ban_t, torch.int64)) if ban_r else None

        # 3. min_tokens: (row, stop token) pairs and the row's threshold; out_len advances per step
        mt_r, mt_t = [], []
        for i, p in enumerate(params):
            if p.min_tokens > len(hist[i][1]):
                stops = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids))
                for tok in dict.fromkeys(stops):
                    mt_r.append(i)
                    mt_t.append(tok)
        self.min_tokens = None
        if mt_r:
            self.min_tokens = (t(mt_r, torch.int64), t(mt_t, torch.int64),
                               t([params[i].min_tokens for i in mt_r], torch.int64))
        self.out_len = t([len(h[1]) for h in hist], torch.int64) if mt_r else None

        # 4. logit_bias: (row, token, bias) triples
        lb = [(i, tok, v) for i, p in enumerate(params) for tok, v in (p.logit_bias or {}).items()]
        self.bias = (t([x[0] for x in lb], torch.int64), t([x[1] for x in lb], torch.int64),
                     t([x[2] for x in lb])) if lb else None

        # 5. penalties: the rows that have any, their output counts [Bp, V] and seen mask [Bp, V]
        self.pen_rows = [i for i, p in enumerate(params) if p.uses_penalties]
        self.penalties = None
        if self.pen_rows:
            pr = [params[i] for i in self.pen_rows]
            counts = torch.zeros(len(pr), vocab_size, dtype=torch.int32, device=self.device)
            seen = torch.zeros(len(pr), vocab_size, dtype=torch.bool, device=self.device)
            rows_o, toks_o, rows_p, toks_p = [], [], [], []
            for j, i in enumerate(self.pen_rows):
                prompt, out = hist[i]
                rows_o += [j] * len(out)
                toks_o += out
                if pr[j].repetition_penalty != 1:
                    rows_p += [j] * len(prompt)
                    toks_p += prompt
            if toks_o:
                ro, to = t(rows_o, torch.int64), t(toks_o, torch.int64)
                counts.index_put_((ro, to), torch.ones_like(to, dtype=torch.int32), accumulate=True)
            if toks_p:
                seen[t(rows_p, torch.int64), t(toks_p, torch.int64)] = True
            self.penalties = (t(self.pen_rows, torch.int64), counts, seen,
                              t([p.presence_penalty for p in pr])[:, None],
                              t([p.frequency_penalty for p in pr])[:, None],
                              t([p.repetition_penalty for p in pr])[:, None])

    @property
    def processes(self) -> bool:
        """Whether any stage between the raw logits and the greedy argmax runs."""
        return (self.token_bitmask is not None or self.banned is not None or self.min_tokens is not None
                or self.bias is not None or self.penalties is not None)

    def advance(self, tokens: torch.Tensor) -> None:
        """Fold one step's sampled tokens [B] (device) into the device state: output counts and
        lengths (multi-token bad words and bitmasks are the host's: host_each_step)."""
        if self.out_len is not None:
            self.out_len += 1
        if self.penalties is not None:
            rows, counts = self.penalties[:2]
            j = torch.arange(len(self.pen_rows), device=self.device)
            tok = tokens[rows]
            counts.index_put_((j, tok), torch.ones_like(tok, dtype=torch.int32), accumulate=True)


def _filter_top_k_top_p(x: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Set to -inf the logits each row does not keep. x: [R, V] float32 (already / temperature);
    k: [R, 1] int64 (V = off); p: [R, 1] float32 in (0, 1]."""
    v = x.shape[-1]
    # Stable descending sort: among equal logits the lower index ranks first (like argmax).
    sorted_x, order = torch.sort(x, dim=-1, descending=True, stable=True)
    rank = torch.arange(v, device=x.device)
    sorted_x = sorted_x.masked_fill(rank[None, :] >= k, _NEG_INF)
    # Nucleus over the top-k survivors: keep token i iff the mass of the tokens ranked above it
    # is < top_p. Rank 0 has mass 0 above it, so at least one token always stays.
    probs = torch.softmax(sorted_x, dim=-1)
    mass_above = torch.cumsum(probs, dim=-1) - probs
    sorted_x = sorted_x.masked_fill((mass_above >= p) & (p < 1.0), _NEG_INF)
    return torch.full_like(x, _NEG_INF).scatter_(-1, order, sorted_x)


class Sampler:
    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> torch.Tensor:
        """logits [B, V] (any float dtype) -> token ids [B] int64, for rows with no history
        (a one-off batch: tests, tools). The engine builds a SamplingBatch per step instead."""
        if logits.dim() != 2:
            raise ValueError(f"Sampler: logits must be [batch, vocab], got shape {tuple(logits.shape)}")
        b, v = logits.shape
        if len(params) != b or len(generators) != b:
            raise ValueError(f"Sampler: {b} logit rows but {len(params)} params and "
                             f"{len(generators)} generators; give one of each per row")
        return self.sample(logits, SamplingBatch(params, generators, logits.device, v)).tokens

    def process(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Stages 1-5 (module docstring): float32 [B, V], a new tensor (logits may be a CUDA
        graph's output buffer, which is never written)."""
        x = logits.float().clone()
        if batch.token_bitmask is not None:
            apply_token_bitmask(x, batch.token_bitmask)
        if batch.banned is not None:
            x.index_put_(batch.banned, x.new_full((), _NEG_INF))
        if batch.min_tokens is not None:
            rows, toks, need = batch.min_tokens
            held = batch.out_len[rows] < need
            x[rows, toks] = torch.where(held, _NEG_INF, x[rows, toks])
        if batch.bias is not None:
            rows, toks, vals = batch.bias
            x.index_put_((rows, toks), vals, accumulate=True)
        if batch.penalties is not None:
            rows, counts, seen, presence, frequency, repetition = batch.penalties
            y = x[rows]
            rep_seen = seen | (counts > 0)
            y = torch.where(rep_seen, torch.where(y > 0, y / repetition, y * repetition), y)
            y = y - frequency * counts.float() - presence * (counts > 0).float()
            x[rows] = y
        return x

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """logits [B, V] (any float dtype) -> SamplerOutput; advances the batch's device state."""
        if logits.dim() != 2 or logits.shape[0] != batch.size:
            raise ValueError(f"Sampler: logits must be [{batch.size}, vocab] for this batch, got "
                             f"{tuple(logits.shape)}")
        out = SamplerOutput(torch.empty(batch.size, dtype=torch.int64, device=logits.device), batch.logprob_rows)
        x = self.process(logits, batch) if batch.processes else logits
        if batch.greedy:
            if not batch.rand:
                out.tokens = x.argmax(dim=-1)
            else:
                out.tokens[batch.greedy_idx] = x[batch.greedy_idx].argmax(dim=-1)
        if batch.rand:
            out.tokens[batch.rand_idx] = self._draw(x[batch.rand_idx].float(), batch)
        if batch.logprob_rows:
            self._logprobs(logits, batch, out)
        batch.advance(out.tokens)
        return out

    @staticmethod
    def _draw(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """One token per random row: x [R, V] float32 (processed logits of batch.rand)."""
        x = x / batch.temp
        if batch.min_p is not None:  # on the tempered distribution, as vLLM
            probs = torch.softmax(x, dim=-1)
            x = x.masked_fill(probs < batch.min_p * probs.amax(dim=-1, keepdim=True), _NEG_INF)
        if batch.top_k is not None:
            x = _filter_top_k_top_p(x, batch.top_k, batch.top_p)
        probs = torch.softmax(x, dim=-1)
        # Exp(1) noise: rows with their own generator draw from it, the rest in one batch.
        q = torch.empty_like(probs)
        gens = batch.rand_gens
        if all(g is None for g in gens):
            q.exponential_()
        else:
            for j, g in enumerate(gens):
                if g is not None:
                    q[j].exponential_(generator=g)
            if batch.no_gen_idx is not None:
                rows = batch.no_gen_idx
                q[rows] = torch.empty(len(rows), x.shape[-1], device=x.device).exponential_()
        # q == 0 is possible in principle; a zero would make 0/0 = NaN win argmax.
        return (probs / q.clamp_min_(1e-30)).argmax(dim=-1)

    @staticmethod
    def _logprobs(logits: torch.Tensor, batch: SamplingBatch, out: SamplerOutput) -> None:
        """Stage 0 for batch.logprob_rows: raw log-softmax, chosen token's logprob, rank, top-k."""
        lp = torch.log_softmax(logits[batch.logprob_idx].float(), dim=-1)
        chosen = out.tokens[batch.logprob_idx]
        out.logprobs = lp.gather(1, chosen[:, None])[:, 0]
        out.ranks = (lp > out.logprobs[:, None]).sum(dim=-1) + 1
        if batch.top_k_logprobs:
            out.top_logprobs, out.top_ids = lp.topk(batch.top_k_logprobs, dim=-1)
