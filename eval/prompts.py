"""Prompt assembly at exact token counts: pieces tokenized separately, joined as token ids.

Each piece (intro, haystack before, needles, haystack after, question) is tokenized on its own
with no special tokens, then the ids are concatenated after the tokenizer's own prefix (Gemma's
<bos>; nothing for SmolLM2). The haystack gets exactly the tokens left over, so the prompt has
exactly the requested length. Needles start with a space and go in after a sentence end of the
haystack (the nearest "." token at or before the wanted depth), so no word is split.

    >>> from infhip.eval.prompts import assemble                             # doctest: +SKIP
    >>> ids = assemble(tok, 1024, intro, [(0.5, needle)], question, "noise", seed=0)  # doctest: +SKIP
    >>> len(ids)  # doctest: +SKIP
    1024
"""

from __future__ import annotations

from infhip.eval.text import token_window


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def special_prefix(tokenizer) -> list[int]:
    """Ids the tokenizer puts in front of any text (e.g. <bos>)."""
    return list(tokenizer("", add_special_tokens=True)["input_ids"])


def _sentence_ends(tokenizer, hay: list[int]) -> list[int]:
    """Indices i such that hay[:i] ends a sentence (token ending with '.'), plus 0."""
    pieces = tokenizer.convert_ids_to_tokens(hay)
    return [0] + [i + 1 for i, p in enumerate(pieces) if p.rstrip().endswith(".")]


def assemble(tokenizer, num_tokens: int, intro: str, needles: list[tuple[float, str]], question: str,
             haystack: str = "noise", seed: int = 0) -> list[int]:
    """Token ids of exactly `num_tokens`: prefix + intro + haystack with each needle inserted at
    its depth (fraction of the haystack, 0..1) + question."""
    prefix, intro_ids, question_ids = special_prefix(tokenizer), encode(tokenizer, intro), encode(tokenizer, question)
    needle_ids = [(depth, encode(tokenizer, text)) for depth, text in needles]
    for depth, _ in needles:
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"depth must be in [0, 1], got {depth}")
    fixed = len(prefix) + len(intro_ids) + len(question_ids) + sum(len(n) for _, n in needle_ids)
    if num_tokens <= fixed:
        raise ValueError(f"{num_tokens} tokens cannot hold the {fixed} tokens of the question and needles")
    hay = token_window(tokenizer, num_tokens - fixed, haystack, seed)
    ends = _sentence_ends(tokenizer, hay)
    inserts = []
    for depth, ids in needle_ids:
        want = round(depth * len(hay))
        cut = max(e for e in ends if e <= want)
        inserts.append((cut, ids))
    inserts.sort(key=lambda x: x[0])  # stable: needles at one cut keep their order
    body, last = [], 0
    for cut, ids in inserts:
        body += hay[last:cut] + ids
        last = cut
    body += hay[last:]
    out = prefix + intro_ids + body + question_ids
    assert len(out) == num_tokens, (len(out), num_tokens)
    return out
