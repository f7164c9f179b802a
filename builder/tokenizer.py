"""Save the source's tokenizer into ``<engine>/tokenizer`` so that it reloads *identically*.

``AutoTokenizer.from_pretrained(<engine>/tokenizer)`` is what the runtime does, and a saved
tokenizer does not always reload as the same thing: transformers 5 picks the class named in
``tokenizer_config.json`` and some classes rebuild their model from the vocabulary instead of
reading ``tokenizer.json`` (a GGUF-converted Gemma tokenizer, a Unigram model, comes back as a
merge-less BPE GemmaTokenizer and splits words into characters). So after saving we reload and
compare token ids on a probe text; on a mismatch the class falls back to the generic
``TokenizersBackend``, which runs ``tokenizer.json`` verbatim.
"""

from __future__ import annotations

import json
from pathlib import Path

# Words, digits, runs of spaces and newlines, accents, CJK, emoji: where tokenizers differ.
PROBE = ("The King James Bible, 1611:\n\nIn the beginning God created the heaven and the earth.  "
         "Naïve café — 東京 🙂 x=3.14159; def f(a, b):\n\treturn a+b  ")


def _encodes_alike(source, saved_dir: Path) -> bool:
    from transformers import AutoTokenizer
    saved = AutoTokenizer.from_pretrained(str(saved_dir))
    return (saved.encode(PROBE) == source.encode(PROBE)
            and saved.eos_token_id == source.eos_token_id and saved.bos_token_id == source.bos_token_id)


def save_tokenizer(tok, dst: Path) -> list[str]:
    """Write ``tok`` to ``dst`` (tokenizer.json, tokenizer_config.json, chat template); return warnings."""
    tok.save_pretrained(str(dst))
    if _encodes_alike(tok, dst):
        return []
    config_path = dst / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    before = config.get("tokenizer_class")
    config["tokenizer_class"] = "TokenizersBackend"
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    if _encodes_alike(tok, dst):
        return [f"tokenizer class {before} reloads differently from the source; saved as TokenizersBackend "
                "(tokenizer.json verbatim)"]
    return ["the saved tokenizer does not reproduce the source tokenizer's ids on a probe text; check it"]
