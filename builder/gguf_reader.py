"""gguf's ``GGUFReader``, parsed ~4-8x faster, with the same fields and tensors.

The stock reader builds one ``np.memmap`` slice per metadata value, each through memmap's
Python-level ``__getitem__`` / ``__array_finalize__``, and walks every array element through the
generic per-field parser: a 262K-token vocabulary (Gemma-3: tokens, scores, token types) is
~800K slices and took ~16-22 s to open (SmolLM2's 49K: ~7 s), on every open (the builder and
transformers each open the file). This subclass

* slices a plain ``ndarray`` view of the same memmap (C-level slicing; the views still keep the
  mapping alive), and
* parses a flat array of scalars or strings in one pass (no per-element enum / dispatch),

and yields the same :class:`ReaderField` structure element for element (``parts``, ``data``,
``types``, offsets): tests/test_builder_gguf.py compares both readers field by field and
tensor by tensor. Byte-swapped files (a GGUF written on the other endianness) and nested
arrays take the stock code paths.

It overrides two private methods of gguf's reader, so :func:`open_gguf` uses it only with the gguf
releases it was compared on (``CHECKED_GGUF``) and gguf's own reader otherwise (slower, the same
values).

    >>> reader = open_gguf("model.gguf")          # doctest: +SKIP
    >>> reader.fields["general.architecture"]      # doctest: +SKIP
"""

from __future__ import annotations

import importlib.metadata
import sys

import numpy as np
from gguf import GGUFReader, GGUFValueType

# gguf releases (major.minor) whose reader FastGGUFReader was compared with, field by field
# (tests/test_builder_gguf.py); with another release open_gguf falls back to gguf's reader.
CHECKED_GGUF = ("0.19",)


def fast_reader_checked() -> bool:
    """Whether the installed gguf is a release FastGGUFReader was checked against."""
    version = importlib.metadata.version("gguf")
    return any(version == v or version.startswith(v + ".") for v in CHECKED_GGUF)


def open_gguf(path) -> GGUFReader:
    """A parsed GGUF file: FastGGUFReader with a checked gguf release, else gguf's GGUFReader."""
    return (FastGGUFReader if fast_reader_checked() else GGUFReader)(str(path))


class FastGGUFReader(GGUFReader):
    def _get(self, offset, dtype, count=1, override_order=None):
        raw = self.__dict__.get("_raw")
        if raw is None:  # the file's bytes as a plain uint8 ndarray (shares the memmap's buffer)
            raw = self._raw = self.data.view(np.ndarray)
        count = int(count)
        dtype = np.dtype(dtype)
        arr = raw[offset:offset + dtype.itemsize * count].view(dtype)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    def _get_field_parts(self, orig_offs, raw_type):
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        offs, n = orig_offs + 12, int(alen[0])
        itype = GGUFValueType(raw_itype[0])
        parts: list[np.ndarray] = [raw_itype, alen]
        nptype = self.gguf_scalar_to_np.get(itype)
        if n and nptype is not None:  # n values of one dtype: one part (a 1-element view) each
            block = self._get(offs, nptype, n)
            parts += list(block.reshape(n, 1))
            return 12 + int(block.nbytes), parts, list(range(2, 2 + n)), [GGUFValueType.ARRAY, itype]
        if n and itype == GGUFValueType.STRING:  # (length, bytes) parts per string, data = the bytes
            raw, native = self._raw, np.dtype(np.uint64).newbyteorder("I")
            u8 = np.dtype(np.uint8).newbyteorder("I")
            mem = memoryview(raw)
            for _ in range(n):
                slen = int.from_bytes(mem[offs:offs + 8], sys.byteorder)
                parts.append(raw[offs:offs + 8].view(native))
                parts.append(raw[offs + 8:offs + 8 + slen].view(u8))
                offs += 8 + slen
            return offs - orig_offs, parts, list(range(3, 3 + 2 * n, 2)), [GGUFValueType.ARRAY, itype]
        return super()._get_field_parts(orig_offs, raw_type)  # empty or nested arrays
