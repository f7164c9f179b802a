"""Incremental detokenization with stop strings.

The completion is re-decoded from its token ids (decoding a suffix alone mis-renders
sentencepiece spaces); text is released only up to the last complete character and never past
the start of a possible stop string, so a streamed delta is never taken back.
"""

from __future__ import annotations


class Detokenizer:
    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.text = ""  # full decoded completion so far (possibly cut at a stop string)
        self.emitted = 0  # characters of self.text already handed out

    def update(self, token_ids: list[int]) -> bool:
        """Decode the completion tokens; returns True when a stop string was found (text cut there)."""
        if self.tokenizer is None:
            return False
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for more tokens
            text = text.rstrip("\ufffd")
        self.text = text
        for s in self.stop:
            # Search only where a new match can start: before the emitted text plus one stop length.
            at = text.find(s, max(0, self.emitted - len(s) + 1))
            if at >= 0:
                self.text = text[:at]
                return True
        return False

    def delta(self, final: bool) -> str:
        """New text safe to emit: hold back a tail that could still become a stop string."""
        safe = len(self.text) if final else max(self.emitted, len(self.text) - max(0, self.max_stop_len - 1))
        out = self.text[self.emitted:safe]
        self.emitted = safe
        return out
