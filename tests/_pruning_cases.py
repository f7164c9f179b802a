"""The cases the SelectRep tests share (tests/test_infinitehip_pruning*.py): random paged
sequences and query blocks, random candidate sets, the kept chunks' scores, un-rotated keys."""

from __future__ import annotations

import torch

from infhip.plugins.infinitehip import PAD, plan_query_blocks, stream_starts
from infhip.plugins.infinitehip.raw_keys import unrotate_keys

from .test_infinitehip_common import DEVICE, PagedSeqs, random_rows

N_SINK, N_STREAM = 4, 8
SHAPES = [(6, 2, 16, 4), (4, 4, 32, 16)]  # Hq, Hkv, D, page_size
QUERIES = [(1, [1, 1]), (8, [13, 20])]  # block_q, q_lens per sequence (decode, prefill blocks)


def random_candidates(g, ends, keep=0.6):
    """A random sorted subset of every block's middle, PAD-padded: (int32 [NB, w], lens [NB])."""
    rows = []
    for s in stream_starts(ends.cpu(), N_SINK, N_STREAM).tolist():
        middle = torch.arange(N_SINK, max(s, N_SINK))
        rows.append(middle[torch.rand(middle.numel(), generator=g) < keep])
    width = max(r.numel() for r in rows) + 3  # trailing padding, like a real buffer
    cand = torch.full((len(rows), width), PAD, dtype=torch.int32)
    for i, r in enumerate(rows):
        cand[i, :r.numel()] = r
    return cand.to(DEVICE), torch.tensor([r.numel() for r in rows], dtype=torch.int32, device=DEVICE)


def chosen_chunk_scores(selected, lens, candidates, scores, chunk_size):
    """Per block, the sorted scores of the chunks a stage kept (tie-proof comparison of top-k)."""
    out = []
    for i in range(selected.shape[0]):
        toks = selected[i, :int(lens[i])].long().cpu()
        if candidates is None:
            idx = toks - N_SINK
        else:
            idx = torch.searchsorted(candidates[i].long().cpu(), toks)
        chunks = torch.unique(idx // chunk_size)
        out.append(sorted(scores[i, chunks].tolist()))
    return out


def setup(Hq, Hkv, D, page_size, q_lens, block_q, seed, dyadic, contexts=(97, 203)):
    seqs = PagedSeqs(list(contexts), Hkv, D, page_size, seed, dyadic=dyadic)
    q = random_rows(seqs.generator, (sum(q_lens), Hq, D), dyadic).to(DEVICE)
    return seqs, q, seqs.blocks(q_lens, block_q)


def raw_keys_of(seqs, q_lens, block_q, freq):
    """RawKeys of every sequence of seqs for the blocks of seqs.blocks(q_lens, block_q)."""
    seq = plan_query_blocks(q_lens, seqs.context_lens.tolist(), block_q, DEVICE)[3]
    return unrotate_keys(seqs.paged, seqs.block_tables, seqs.context_lens.tolist(), freq, seq.long())
