"""Command-line pieces shared by infhip-build, infhip-run, infhip-serve, infhip-eval and
infhip-export-triton: knob specs ``KEY=VALUE,...`` (each method parses its own through
``Method.parse``; this is the default reading), positive integers, renamed flags.

    >>> parse_knobs("a=1,b=x,c=[32,16,8]")
    {'a': 1, 'b': 'x', 'c': [32, 16, 8]}
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def positive_int(text: str) -> int:
    """An argparse type: a positive integer, else a usage error that says so."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def parse_knobs(spec: str, what: str = "knobs") -> dict[str, Any]:
    """'a=1,b=x,c=[32,16,8]' -> {'a': 1, 'b': 'x', 'c': [32, 16, 8]}: knobs as given on a command
    line (values as JSON where they parse, else strings; commas inside brackets do not split).
    ValueError names the part that is not KEY=VALUE (``what``: whose knobs, for the message)."""
    out, depth, start, parts = {}, 0, 0, []
    for i, ch in enumerate(spec + ","):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            parts.append(spec[start:i])
            start = i + 1
    for part in filter(None, (x.strip() for x in parts)):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{what} are KEY=VALUE pairs separated by commas, got {part!r}")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value.strip()
    return out


class _Renamed(argparse.Action):
    def __init__(self, option_strings, dest, hint: str = "", **kwargs):
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS, **kwargs)
        self.hint = hint

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} was renamed: {self.hint}")


def add_renamed_flag(parser: argparse.ArgumentParser, old: str, hint: str) -> None:
    """A flag that no longer exists: giving it is a usage error (exit 2) that says ``hint``,
    e.g. "use --kv-offload-bytes 8GiB". Hidden from --help."""
    parser.add_argument(old, action=_Renamed, hint=hint, dest="_renamed_" + old.lstrip("-").replace("-", "_"))


__all__ = ["add_renamed_flag", "parse_knobs", "positive_int"]
