"""Sampled tokens and logprobs from the device to the host in one copy per step, and the prompt's
logprobs (SamplingParams.prompt_logprobs) from a step's hidden rows: `EngineCore`'s helpers
(runtime/engine_core.py)."""

from __future__ import annotations

import torch

from infhip.plugins.sampling import logprobs
from infhip.runtime.outputs import TokenLogprobs
from infhip.runtime.sampler import SamplerOutput
from infhip.runtime.scheduler import SchedulerOutput
from infhip.runtime.sequence import Sequence

PROMPT_LOGPROB_ROWS = 512  # prompt positions per LM-head slice ([rows, vocab] float32 at a time)


def unpack_logprobs(flat: list[float], chosen: list[int], k: int) -> list[TokenLogprobs]:
    w = 2 + 2 * k
    out = []
    for j, tok in enumerate(chosen):
        r = flat[j * w:(j + 1) * w]
        out.append(TokenLogprobs(tok, r[0], int(r[1]), [(int(i), x) for x, i in zip(r[2:2 + k], r[2 + k:])]))
    return out


def read_samples(outs: list[SamplerOutput]) -> tuple[list[list[int]], list[list[float] | None]]:
    """The tokens of each SamplerOutput and its packed logprobs (`logprob_records`' input, None
    where no row asked), read to the host in one copy: float64 holds token ids, ranks and the
    float32 logprobs exactly."""
    parts = [torch.stack([so.tokens for so in outs]).flatten().double()]
    sizes = []
    for so in outs:
        parts += [so.logprobs.flatten().double()] if so.logprob_rows else []
        sizes.append(so.logprobs.numel() if so.logprob_rows else 0)
    flat = torch.cat(parts).tolist()
    b = outs[0].tokens.numel()
    tokens = [[int(t) for t in flat[j * b:(j + 1) * b]] for j in range(len(outs))]
    at, lps = len(outs) * b, []
    for n in sizes:
        lps.append(flat[at:at + n] if n else None)
        at += n
    return tokens, lps


def logprob_records(so: SamplerOutput, seqs: list[Sequence], tokens: list[int],
                    flat: list[float] | None) -> dict[int, TokenLogprobs]:
    """seq_id -> the sampled token's TokenLogprobs (top cut to the row's own k) for the rows of
    ``so`` that computed them; tokens and flat: as `read_samples` read them."""
    if not so.logprob_rows:
        return {}
    recs = unpack_logprobs(flat, [tokens[row] for row in so.logprob_rows], so.top_k)
    out = {}
    for row, r in zip(so.logprob_rows, recs):
        seq = seqs[row]
        r.top = r.top[:seq.params.logprobs or 0]
        out[seq.seq_id] = r
    return out


def prompt_rows(out: SchedulerOutput, request_of) -> tuple[list[int], list[tuple[object, int, int]]]:
    """prompt_logprobs: (the step's hidden rows to keep, and per request (req, lo, hi): those
    rows are positions [lo, hi), each predicting the prompt token after it); request_of: a
    sequence's Request."""
    rows, spans, row0 = [], [], 0
    for ch in out.chunks:
        seq = ch.seq
        if seq.params.prompt_logprobs is not None:
            hi = min(ch.end, seq.num_prompt_tokens - 1)
            if ch.start < hi:
                rows += range(row0 + 0, row0 + hi - ch.start)
                spans.append((request_of(seq), ch.start, hi))
        row0 += ch.num_tokens
    return rows, spans


@torch.inference_mode()
def record_prompt_logprobs(compute_logits, hidden: torch.Tensor, spans: list[tuple[object, int, int]]) -> None:
    """Fill req.prompt_logprobs[lo + 1 : hi + 1] from the hidden states of positions [lo, hi)
    (in spans' order), LM head (``compute_logits``) and logprobs (plugins/sampling.py, as for
    sampled tokens) a slice of rows at a time (a long prompt's logits at once would be
    [tokens, vocab])."""
    targets = [t for req, lo, hi in spans for t in req.seq.prompt_token_ids[lo + 1:hi + 1]]
    k = max(req.params.prompt_logprobs for req, _, _ in spans)
    tgt = torch.tensor(targets, dtype=torch.int64, device=hidden.device)
    packed = []
    for i in range(0, len(targets), PROMPT_LOGPROB_ROWS):
        x = compute_logits(hidden[i:i + PROMPT_LOGPROB_ROWS])
        rows = torch.arange(x.shape[0], device=x.device)
        packed.append(logprobs(x, rows, tgt[i:i + PROMPT_LOGPROB_ROWS], k).flatten())
    recs = unpack_logprobs(torch.cat(packed).tolist(), targets, k)
    j = 0
    for req, lo, hi in spans:
        kk = req.params.prompt_logprobs
        for pos in range(lo + 1, hi + 1):
            r = recs[j]
            req.prompt_logprobs[pos] = TokenLogprobs(r.token_id, r.logprob, r.rank, r.top[:kk])
            j += 1
