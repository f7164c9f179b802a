"""Shared by the real-model tests (test_real_*.py, test_lm_eval.py): transformers' GGUF loading
with one parse of the file.

transformers opens a GGUF with ``gguf.GGUFReader`` on every call, twice per
``AutoModelForCausalLM.from_pretrained`` (config, then weights) and once per tokenizer; with gguf's
own reader each open of Gemma-3-270M's 262K-token vocabulary took ~16 s (SmolLM2 ~7 s, Qwen2.5
0.5B ~13 s, idle VM). Inside :func:`one_gguf_parse` every open of a path returns one parse of it
by :class:`~infhip.builder.gguf_reader.FastGGUFReader` (open_gguf), whose fields and tensors equal the stock
reader's (test_builder_gguf.py::test_fast_gguf_reader_equals_gguf_reader), so transformers builds
the same reference model and tokenizer from the same values; it still does its own
dequantisation and conversion (the code the builder is compared against). gguf's tensor-name map
(a pure function of architecture and layer count, rebuilt per module: ~4 s) is memoised too."""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path


@contextlib.contextmanager
def one_gguf_parse():
    """``with one_gguf_parse(): AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)``"""
    import gguf
    from infhip.builder.gguf_reader import open_gguf

    @functools.lru_cache(maxsize=None)
    def parsed(path: Path, mtime_ns: int):
        return open_gguf(path)

    def reader(path, *args, **kwargs):
        assert not args and not kwargs, (args, kwargs)  # read-only opens (mode "r") only
        path = Path(path).resolve()
        return parsed(path, path.stat().st_mtime_ns)

    saved = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = reader
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(saved[1])  # as the builder does (~4 s)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = saved
