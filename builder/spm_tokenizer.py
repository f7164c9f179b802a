"""SentencePiece-BPE tokenizers from GGUF metadata (Gemma, Llama-2/Mistral-v0.1 style GGUFs).

A GGUF with ``tokenizer.ggml.model == "llama"`` stores a SentencePiece BPE vocabulary as pieces
and scores, without merges. SentencePiece encodes by repeatedly merging the adjacent pair whose
joined piece is in the vocabulary with the highest score; that is BPE with one merge per
(left, right) split of every piece, ranked by the joined piece's score. transformers' GGUF
conversion instead builds a Unigram model for Gemma-3, which splits words into fragments the
model never saw (" there" -> "▁t he re"; KJV perplexity of Gemma-3-270M 138 vs 11.9 with this
tokenizer at 1K tokens, `infhip-eval ppl`). This module builds the BPE form with `tokenizers`.

Pieces: "▁" marks a space; ``<0xNN>`` pieces are the byte fallback; control (type 3) and
user-defined (type 4) pieces are matched whole as special tokens.
"""

from __future__ import annotations

NORMAL, CONTROL, USER_DEFINED = 1, 3, 4


def _field(reader, name: str, default=None):
    field = reader.fields.get(name)
    if field is None:
        return default
    parts = [field.parts[i] for i in field.data]
    return parts


def _string(reader, name: str) -> str | None:
    parts = _field(reader, name)
    return bytes(parts[0]).decode("utf-8") if parts else None


def _scalar(reader, name: str, default):
    parts = _field(reader, name)
    return parts[0].tolist()[0] if parts else default


def sentencepiece_bpe_from_gguf(reader):
    """A transformers tokenizer for an SPM-BPE GGUF, or None when the GGUF holds another kind
    (e.g. GPT-2 style BPE with merges, which transformers converts faithfully)."""
    if _string(reader, "tokenizer.ggml.model") != "llama" or "tokenizer.ggml.merges" in reader.fields:
        return None
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors
    from transformers import PreTrainedTokenizerFast

    pieces = [bytes(p).decode("utf-8", errors="replace") for p in _field(reader, "tokenizer.ggml.tokens")]
    scores = [float(s[0]) for s in _field(reader, "tokenizer.ggml.scores")]
    types = [int(t[0]) for t in _field(reader, "tokenizer.ggml.token_type")]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    mergeable = {i for i, t in enumerate(types) if t in (NORMAL, USER_DEFINED)}
    # One merge per split of every normal piece into two mergeable pieces, best-scored first.
    ranked = []
    for i, piece in enumerate(pieces):
        if types[i] != NORMAL:
            continue
        for cut in range(1, len(piece)):
            left, right = vocab.get(piece[:cut]), vocab.get(piece[cut:])
            if left in mergeable and right in mergeable:
                ranked.append((-scores[i], i, left, right))
    ranked.sort()
    merges = [(pieces[left], pieces[right]) for _, _, left, right in ranked]

    unk = pieces[_scalar(reader, "tokenizer.ggml.unknown_token_id", 0)]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, byte_fallback=True, fuse_unk=True))
    steps = [normalizers.Replace(" ", "▁")]
    decode = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if _scalar(reader, "tokenizer.ggml.add_space_prefix", False):
        steps.insert(0, normalizers.Prepend("▁"))
        decode.append(decoders.Strip(" ", 1, 0))
    tok.normalizer = normalizers.Sequence(steps)
    tok.decoder = decoders.Sequence(decode)
    tok.add_special_tokens([AddedToken(p, special=True, normalized=False)
                            for p, t in zip(pieces, types) if t in (CONTROL, USER_DEFINED)])

    bos_id = _scalar(reader, "tokenizer.ggml.bos_token_id", None)
    eos_id = _scalar(reader, "tokenizer.ggml.eos_token_id", None)
    if bos_id is not None and _scalar(reader, "tokenizer.ggml.add_bos_token", True):
        bos = pieces[bos_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
    pad_id = _scalar(reader, "tokenizer.ggml.padding_token_id", None)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token=unk,
        bos_token=pieces[bos_id] if bos_id is not None else None,
        eos_token=pieces[eos_id] if eos_id is not None else None,
        pad_token=pieces[pad_id] if pad_id is not None else None)
    template = _string(reader, "tokenizer.chat_template")
    if template:
        fast.chat_template = template
    return fast
