"""Token sampling from the last-position logits of a batch, on the device, batched.

A step builds one `SamplingBatch` on the host (the rows' parameters as device tensors, two
packed copies for stages 2-5; penalized rows name their slot in the engine's device tables of
output counts, runtime/penalty_slots.py, so nothing of size V is built on the host);
`Sampler.sample(logits, batch)` then only launches kernels: no host sync, no host-to-device
copy, so a run of back-to-back decode steps (EngineCore._decode_steps, after each CUDA-graph
replay: the graphs end at the logits, sampling is outside them) calls it once per step and the
batch's device state (output counts, output lengths) advances on the device with the sampled
tokens. On the GPU stages 1-5 are one launch, the advance one, logprobs two
(plugins/sampling.py); elsewhere their plain-torch references run.

What happens to a row's logits, in this order (vLLM's order); each stage runs only when some
row of the batch uses it, so a batch of plain requests pays for none of them:
  0. logprobs: of the raw model logits (before everything below), the chosen token's
     logprob, its rank and the top-k, for the rows with `logprobs` set (or best_of > n);
  1. token bitmask: ``batch.token_bitmask`` [B, ceil(V / 32)] int32, bit t % 32 of word t // 32
     set = token t allowed (xgrammar's layout; `apply_token_bitmask`). THE place for
     structured output: whoever constrains a row fills its bitmask row (all bits set = free)
     before `sample`, and sets ``batch.host_each_step`` (a grammar advances on the host after
     every token: between back-to-back decode steps the engine does that, and refills the
     mask, while the next step's forward runs; EngineCore._decode_steps);
  2. bad words: single tokens always; a multi-token word bans its last token where the output
     ends with the others (matched on the host at build: ``host_each_step``, and the engine
     runs one decode step at a time);
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

from infhip.plugins._triton_utils import use_triton
from infhip.plugins.sampling import (NEVER_DONE, advance_ref, advance_triton, apply_token_bitmask, logprobs, stages_ref,
                                     stages_triton)
from infhip.runtime.penalty_slots import PenaltySlots
from infhip.runtime.sampling_params import SamplingParams

__all__ = ["Sampler", "SamplerOutput", "SamplingBatch", "apply_token_bitmask", "make_generator"]


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


@dataclass
class SamplerOutput:
    """tokens [B] int64; for the rows ``logprob_rows`` (host list, batch order) ``logprobs``
    [R, 2 + 2K] float32: the chosen token's raw logprob, its rank (1 = most likely), the top K
    logprobs and their token ids (K = ``top_k``, the largest logprobs asked in the batch; a row
    asking fewer reads its first ones; plugins/sampling.py). On the device until read."""

    tokens: torch.Tensor
    logprob_rows: list[int]
    logprobs: torch.Tensor | None = None
    top_k: int = 0


class SamplingBatch:
    """One step's rows as the sampler needs them; built on the host once per step (and kept
    across back-to-back decode steps, whose tokens `Sampler.sample` folds into the counts).

    histories: per row (prompt token ids, output token ids so far), for penalties, min_tokens and
    bad words; None = empty (a row with none of those features needs none).
    eos_token_ids: the model's EOS tokens (min_tokens holds them back unless ignore_eos).
    penalty_slots, keys: the engine's device penalty tables (runtime/penalty_slots.py) and each
    row's key in them (its Sequence); None = tables of this batch alone, filled from histories.

    Stages 2-5 reach the device as two packed copies (one int32, one float32) per step, sliced
    into the stages kernel's arrays (plugins/sampling.py): the sparse entries (CSR per row) and
    out_len, the rows' penalty slots and their (repetition, frequency, presence)."""

    def __init__(self, params: Seq[SamplingParams], generators: Seq[torch.Generator | None],
                 device: torch.device | str, vocab_size: int,
                 histories: Seq[tuple[list[int], list[int]]] | None = None,
                 eos_token_ids: Seq[int] = (), penalty_slots: PenaltySlots | None = None,
                 keys: Seq[object] | None = None):
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

        # 2-4. sparse entries per row: (token, value, applied while the output is shorter than need)
        ents: list[list[tuple[int, float, int]]] = [[] for _ in range(b)]
        for i, (p, (_, out)) in enumerate(zip(params, hist)):
            for q in p.bad_words_token_ids or ():  # 2. bad words
                if len(q) > 1:
                    self.host_each_step = True
                if len(q) == 1 or (len(out) >= len(q) - 1 and out[len(out) - len(q) + 1:] == q[:-1]):
                    ents[i].append((q[-1], _NEG_INF, NEVER_DONE))
            if p.min_tokens > len(out):  # 3. min_tokens
                stops = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids))
                ents[i] += [(tok, _NEG_INF, p.min_tokens) for tok in dict.fromkeys(stops)]
            ents[i] += [(tok, float(v), NEVER_DONE) for tok, v in (p.logit_bias or {}).items()]  # 4. logit_bias
        ints, floats = [], []  # the packed copies
        has_entries = any(ents)
        self._min_tokens = any(e[2] != NEVER_DONE for row in ents for e in row)
        if has_entries:
            flat = [e for row in ents for e in row]
            ptr = [0]
            for row in ents:
                ptr.append(ptr[-1] + len(row))
            ints += ptr + [e[0] for e in flat] + [e[2] for e in flat] + [len(h[1]) for h in hist]
            floats += [e[1] for e in flat]

        # 5. penalties: the rows' slots in the device tables (-1: none) and their factors
        self.pen_rows = [i for i, p in enumerate(params) if p.uses_penalties]
        self._slots = None
        if self.pen_rows:
            if penalty_slots is None:
                penalty_slots, keys = PenaltySlots(vocab_size, self.device), list(range(b))
            self._slots, self._pen_keys = penalty_slots, [keys[i] for i in self.pen_rows]
            taken = penalty_slots.take([(keys[i], hist[i][0], hist[i][1], params[i].repetition_penalty != 1)
                                        for i in self.pen_rows])
            slot = [-1] * b
            for i, s in zip(self.pen_rows, taken):
                slot[i] = s
            ints += slot
            floats += [x for p in params for x in (p.repetition_penalty, p.frequency_penalty, p.presence_penalty)]

        # one copy each; the kernels read the slices
        iv = t(ints, torch.int32) if ints else None
        fv = t(floats) if floats else None
        self.entries = self.penalties = None
        if has_entries:
            e = len(flat)
            ep, tok, need, out_len = torch.split(iv[:2 * b + 1 + 2 * e], [b + 1, e, e, b])
            self.entries = (ep, tok, need, fv[:e], out_len)
        if self.pen_rows:
            self.penalties = (iv[-b:], fv[-3 * b:].view(b, 3), penalty_slots.counts, penalty_slots.seen)

    @property
    def out_len(self) -> torch.Tensor | None:
        """[B] int32: each row's output length, advanced per decode step while a min_tokens
        entry reads it (bans and biases hold whatever the length)."""
        return self.entries[4] if self._min_tokens else None

    @property
    def processes(self) -> bool:
        """Whether any stage between the raw logits and the greedy argmax runs."""
        return self.token_bitmask is not None or self.entries is not None or self.penalties is not None

    def advance(self, tokens: torch.Tensor) -> None:
        """Fold one step's sampled tokens [B] (device) into the device state: output lengths and
        the penalty rows' counts (multi-token bad words and bitmasks are the host's:
        host_each_step). One launch on the GPU, none for a batch without either."""
        if self.out_len is None and self.penalties is None:
            return
        if use_triton(tokens):
            advance_triton(tokens, self.out_len, self.penalties)
        else:
            advance_ref(tokens, self.out_len, self.penalties)
        if self._slots is not None:
            self._slots.folded(self._pen_keys)


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
        graph's output buffer, which is never written). On the GPU one launch
        (plugins/sampling.py, stages), elsewhere its plain-torch reference."""
        if use_triton(logits):
            x = logits if logits.dtype == torch.float32 and logits.is_contiguous() else logits.float().contiguous()
            return stages_triton(x, batch.token_bitmask, batch.entries, batch.penalties)
        return stages_ref(logits, batch.token_bitmask, batch.entries, batch.penalties)

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
        """Stage 0 for batch.logprob_rows, on the raw logits (plugins/sampling.py: two launches
        on the GPU)."""
        out.top_k = batch.top_k_logprobs
        out.logprobs = logprobs(logits, batch.logprob_idx, out.tokens, out.top_k)
