"""Sampled tokens and logprobs from the device to the host in one copy per step, and the prompt's
logprobs (SamplingParams.prompt_logprobs) from a step's hidden rows: `EngineCore`'s helpers
(runtime/engine_core.py)."""

from __future__ import annotations

import torch

from infhip.runtime.outputs import TokenLogprobs
from infhip.runtime.sampler import SamplerOutput
from infhip.runtime.scheduler import SchedulerOutput
from infhip.runtime.sequence import Sequence

PROMPT_LOGPROB_ROWS = 512  # prompt positions per LM-head slice ([rows, vocab] float32 at a time)


def pack_logprobs(lp: torch.Tensor, chosen: torch.Tensor, k: int) -> torch.Tensor:
    """One flat float32 tensor of rows' [logprob, rank, k top logprobs, k top ids] (ids and ranks
    are exact in float32 below 2**24), so that the host reads them in one copy."""
    c = lp.gather(1, chosen[:, None])
    rank = (lp > c).sum(dim=-1, keepdim=True).float() + 1
    parts = [c, rank]
    if k:
        top_lp, top_ids = lp.topk(k, dim=-1)
        parts += [top_lp, top_ids.float()]
    return torch.cat(parts, dim=1).flatten()


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
        if so.logprob_rows:
            k = so.top_ids.shape[1] if so.top_ids is not None else 0
            cols = [so.logprobs[:, None], so.ranks[:, None].float()]
            cols += [so.top_logprobs, so.top_ids.float()] if k else []
            parts.append(torch.cat(cols, dim=1).flatten().double())
            sizes.append(parts[-1].numel())
        else:
            sizes.append(0)
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
    k = so.top_ids.shape[1] if so.top_ids is not None else 0
    recs = unpack_logprobs(flat, [tokens[row] for row in so.logprob_rows], k)
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
    (in spans' order), LM head (``compute_logits``) and log-softmax a slice of rows at a time (a
    long prompt's logits at once would be [tokens, vocab])."""
    targets = [t for req, lo, hi in spans for t in req.seq.prompt_token_ids[lo + 1:hi + 1]]
    k = max(req.params.prompt_logprobs for req, _, _ in spans)
    tgt = torch.tensor(targets, dtype=torch.int64, device=hidden.device)
    packed = []
    for i in range(0, len(targets), PROMPT_LOGPROB_ROWS):
        lp = torch.log_softmax(compute_logits(hidden[i:i + PROMPT_LOGPROB_ROWS]).float(), -1)
        packed.append(pack_logprobs(lp, tgt[i:i + PROMPT_LOGPROB_ROWS], k))
    recs = unpack_logprobs(torch.cat(packed).tolist(), targets, k)
    j = 0
    for req, lo, hi in spans:
        kk = req.params.prompt_logprobs
        for pos in range(lo + 1, hi + 1):
            r = recs[j]
            req.prompt_logprobs[pos] = TokenLogprobs(r.token_id, r.logprob, r.rank, r.top[:kk])
            j += 1
