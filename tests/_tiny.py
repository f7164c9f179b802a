"""The tests' tiny engines: the tiny random checkpoints of infhip.builder.tiny_checkpoint (every
supported architecture; re-exported here for the tests) built once per key, and the engine the
API and server tests serve."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from infhip.builder.tiny_checkpoint import ARCHS, write_tiny_hf_checkpoint, write_tiny_tokenizer  # noqa: F401


class TinyEngines:
    """Tiny checkpoints and engines built once per key under ``root`` and handed out again: the
    session-wide cache behind conftest's ``tiny_checkpoint`` / ``tiny_engine`` fixtures (one per
    pytest-xdist worker, each worker being its own session). Callers must treat what they get as
    read-only (copy an engine before editing it).

        >>> engines = TinyEngines(tmp_path)                                    # doctest: +SKIP
        >>> engines.engine("llama", preset="3k", max_seq_len=200)             # doctest: +SKIP
        PosixPath('.../llama-0/e1')
    """

    # what every tiny engine is built with unless told otherwise
    BUILD_DEFAULTS = dict(dtype="float32", device="cpu", progress=False)

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self._checkpoints: dict[str, Path] = {}
        self._engines: dict[str, Path] = {}

    @staticmethod
    def _key(*parts: Any) -> str:
        return json.dumps(parts, sort_keys=True, default=repr)

    def checkpoint(self, arch: str = "llama", tokenizer: bool = False, seed: int = 0, **overrides: Any) -> Path:
        """The folder of ``write_tiny_hf_checkpoint(..., arch, seed, tokenizer, **overrides)``."""
        key = self._key(arch, tokenizer, seed, overrides)
        if key not in self._checkpoints:
            path = self.root / f"{arch}-{len(self._checkpoints)}"
            write_tiny_hf_checkpoint(path / "hf", arch, seed=seed, tokenizer=tokenizer, **overrides)
            self._checkpoints[key] = path / "hf"
        return self._checkpoints[key]

    def engine(self, arch: str = "llama", *, tokenizer: bool = False, hf: dict[str, Any] | None = None,
               **build: Any) -> Path:
        """The engine ``build_engine(checkpoint=<tiny arch checkpoint>, **BUILD_DEFAULTS, **build)``
        builds; ``hf`` are the checkpoint's config overrides (``write_tiny_hf_checkpoint``)."""
        from infhip.builder.build import build_engine
        src = self.checkpoint(arch, tokenizer=tokenizer, **(hf or {}))
        build = {**self.BUILD_DEFAULTS, **build}
        key = self._key(str(src), build)
        if key not in self._engines:
            out = src.parent / f"e{len(self._engines)}"
            self._engines[key] = Path(build_engine(checkpoint=src, output_dir=out, **build))
        return self._engines[key]


# The engine the API and server tests serve: the tiny Llama with a tokenizer, 128 positions.
API_ENGINE = dict(tokenizer=True, max_seq_len=128, max_batch_size=4)


def build_tiny_api_engine(root: str | Path, max_batch_size: int = 4) -> Path:
    """A float32 CPU engine of the tiny Llama with a tokenizer (max_seq_len 128, 4 sequences
    unless told) under root: what the API and server tests serve."""
    from infhip.builder.build import build_engine
    root = Path(root)
    write_tiny_hf_checkpoint(root / "hf", "llama", tokenizer=True)
    return build_engine(checkpoint=root / "hf", output_dir=root / "engine", dtype="float32", device="cpu",
                        max_seq_len=128, max_batch_size=max_batch_size, progress=False)
