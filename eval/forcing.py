"""Teacher forcing through the engine's own scheduler and runner.

The runtime returns logits of a chunk's last token only. To score every position of a target
span we prefill the context once and then feed the *true* next tokens as if they had been
sampled: each decode step returns the logits that predict the following target. Cost: one
prefill of the context + one decode step per target token, with the KV cache reused, i.e.
O(T + C) tokens of compute for C targets after T context tokens — the cheapest exact way without
touching the runtime (re-prefilling every prefix would cost O(C * T)). Several items run as one
continuous batch, so the decode steps of all items share each weight read.

    >>> from infhip import LLM                                                 # doctest: +SKIP
    >>> llm = LLM("engines/smollm2-135m")  # doctest: +SKIP
    >>> for item, j, logits in teacher_force(llm, [(ctx_ids, target_ids)]):  # doctest: +SKIP
    ...     nll = -logits.log_softmax(-1)[target_ids[j]]
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence as Seq

import torch

from infhip.runtime.sampling_params import SamplingParams
from infhip.runtime.sequence import Sequence

_ids = itertools.count(1 << 40)  # sequence ids far from the LLM's own counter


def teacher_force(llm, items: Seq[tuple[list[int], list[int]]]) -> Iterator[tuple[int, int, torch.Tensor]]:
    """For items (context ids, target ids) yield (item index, j, float32 logits [vocab]) where the
    logits predict target j given context + targets[:j]. Every item yields len(targets) times, j
    ascending per item; items interleave. Contexts must be non-empty."""
    seqs: dict[int, tuple[int, Sequence, list[int]]] = {}
    for i, (ctx, targets) in enumerate(items):
        if not ctx:
            raise ValueError(f"item {i}: teacher forcing needs at least one context token")
        if not targets:
            continue
        limit = llm.scheduler.max_seq_len
        if len(ctx) + len(targets) > limit:  # the scheduler stops a sequence that reaches it
            raise ValueError(f"item {i}: {len(ctx)} context + {len(targets)} target tokens exceed the "
                             f"engine's max_seq_len {limit}; rebuild with a larger --max-seq-len")
        seq = Sequence(seq_id=next(_ids), prompt_token_ids=list(ctx),
                       params=SamplingParams(max_tokens=len(targets) + 1, temperature=0.0, ignore_eos=True))
        seqs[seq.seq_id] = (i, seq, list(targets))
        llm.scheduler.add(seq)
    done: dict[int, int] = {sid: 0 for sid in seqs}  # targets yielded so far
    try:
        while any(done[sid] < len(t) for sid, (_, _, t) in seqs.items()):
            out = llm.scheduler.schedule()
            if out.is_empty:
                raise RuntimeError("scheduler made no progress (KV cache too small for these items?)")
            logits = llm.runner.execute(out)
            rows = [ch for ch in out.chunks if ch.needs_logits]
            forced, finished = {}, []
            for row, ch in zip(logits, rows):
                sid = ch.seq.seq_id
                i, seq, targets = seqs[sid]
                j = done[sid]
                yield i, j, row
                done[sid] = j + 1
                forced[sid] = targets[j]
                if j + 1 == len(targets):
                    finished.append(seq)
            llm.scheduler.update(out, forced, ())
            for seq in finished:  # its last target needs no KV: stop it before it is scheduled again
                if not seq.is_finished:
                    llm.scheduler.finish(seq, "abort")
    finally:  # an abandoned generator must not leave sequences holding KV pages
        for _, seq, _ in seqs.values():
            if not seq.is_finished:
                llm.scheduler.finish(seq, "abort")


def target_log_probs(llm, items: Seq[tuple[list[int], list[int]]]) -> list[torch.Tensor]:
    """float64 [len(targets)] log-probability of each target token, per item.

        >>> lp = target_log_probs(llm, [(ctx, tgt)])[0]                       # doctest: +SKIP
        >>> ppl = (-lp.mean()).exp()  # doctest: +SKIP
    """
    out = [torch.empty(len(t), dtype=torch.float64) for _, t in items]
    for i, j, logits in teacher_force(llm, items):
        out[i][j] = logits.double().log_softmax(-1)[items[i][1][j]]
    return out
