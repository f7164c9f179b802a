"""Knobs on command lines: ``KEY=VALUE,...`` specs, shared by infhip-build, infhip-run,
infhip-serve and infhip-eval. One name per knob: the field names of infhip/knobs.py and
infhip/token_drop_knobs.py.

    --infinitehip-overrides chunk_score=max,refresh_intervals=[32,16,8]   parse_knobs
    --token-drop                                     the defaults (p=0.99,obs_window=128,block_size=64,
                                                     num_sink=128,min_prompt_len=8192,drop_layers=auto,
                                                     drop_point=after_attention,reenter=false,spare_anchors=0)
    --token-drop drop_layers=5:8:11,reenter=true     layer lists joined by ':' (commas split knobs)
    --token-drop p=0.98,block_size=32                some knobs changed                 parse_token_drop
    --token-drop off | on                            (at load) off, or as built / the defaults

    >>> parse_token_drop("p=0.98,block_size=32").block_size
    32
    >>> parse_knobs("a=1,b=x,c=[32,16,8]")
    {'a': 1, 'b': 'x', 'c': [32, 16, 8]}
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from infhip.token_drop_knobs import RENAMED_TOKEN_DROP_KNOBS, RETENTION_MOVED, TokenDropConfig

_TOKEN_DROP_KEYS = tuple(f.name for f in dataclasses.fields(TokenDropConfig))
_FLOATS = ("p",)
_STRINGS = ("drop_layers", "drop_point")  # parsed by TokenDropConfig (drop_layers: auto | every | 5:8:11)
_BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def parse_knobs(spec: str) -> dict[str, Any]:
    """'a=1,b=x,c=[32,16,8]' -> {'a': 1, 'b': 'x', 'c': [32, 16, 8]}: InfiniteHiP knobs as given on
    a command line (values as JSON where they parse, else strings; commas inside brackets do not
    split). ValueError names the part that is not KEY=VALUE."""
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
            raise ValueError(f"InfiniteHiP knobs are KEY=VALUE pairs separated by commas, got {part!r}")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value.strip()
    return out


def parse_token_drop(text: str) -> TokenDropConfig:
    """Parse ``key=value,...`` (empty: defaults). Raises ValueError with a one-line fix."""
    return TokenDropConfig(**parse_token_drop_knobs(text))  # range checks there, one line each


def parse_token_drop_knobs(text: str) -> dict[str, Any]:
    """``key=value,...`` -> {field name: typed value} of the given keys only (to lay over an
    engine's own knobs: ``LLM(..., token_drop=knobs)``). Raises ValueError with a one-line fix;
    an old short key (G, n, A, min_len, spare, rho) gets the name to use instead."""
    knobs: dict[str, Any] = {}
    keys = ", ".join(_TOKEN_DROP_KEYS)
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not value:
            raise ValueError(f"--token-drop item {item!r} is not key=value (keys: {keys}), "
                             "e.g. --token-drop p=0.98,block_size=32")
        if key in RENAMED_TOKEN_DROP_KNOBS:
            new = RENAMED_TOKEN_DROP_KNOBS[key]
            raise ValueError(f"--token-drop: key {key!r} is now called {new!r}: --token-drop {new}={value}")
        if key in ("rho", "retention"):
            raise ValueError(f"--token-drop: {RETENTION_MOVED}")
        if key not in _TOKEN_DROP_KEYS:
            raise ValueError(f"--token-drop: unknown key {key!r}; keys: {keys}")
        if key in knobs:
            raise ValueError(f"--token-drop: {key!r} given twice")
        if key in _STRINGS:
            knobs[key] = value
            continue
        if key == "reenter":
            if value.lower() not in _BOOLS:
                raise ValueError(f"--token-drop: reenter={value!r} must be true or false")
            knobs[key] = _BOOLS[value.lower()]
            continue
        try:
            knobs[key] = float(value) if key in _FLOATS else int(value)
        except ValueError:
            kind = "a number" if key in _FLOATS else "an integer"
            raise ValueError(f"--token-drop: {key}={value!r} must be {kind}") from None
    TokenDropConfig(**knobs)  # range checks, one line each
    return knobs


def parse_token_drop_option(spec: str | None) -> bool | dict | None:
    """A load's --token-drop: None (as built), off -> False, on -> True (as built, or the
    defaults), else the knobs laid over the engine's (``LLM(token_drop=...)``)."""
    if spec is None:
        return None
    if spec.strip().lower() in ("off", "on"):
        return spec.strip().lower() == "on"
    return parse_token_drop_knobs(spec)


def token_drop_config(value: "TokenDropConfig | dict | str | bool | None") -> TokenDropConfig | None:
    """Normalise the forms accepted by build_engine: None/False = off, True = defaults, a spec
    string, a dict of knobs (field names) or a TokenDropConfig."""
    if value is None or value is False:
        return None
    if value is True:
        return TokenDropConfig()
    if isinstance(value, TokenDropConfig):
        return value
    if isinstance(value, str):
        return parse_token_drop(value)
    if isinstance(value, dict):
        return TokenDropConfig().replace(**value)
    raise TypeError(f"token_drop must be None, a bool, a spec string, a dict or a TokenDropConfig; "
                    f"got {type(value).__name__}")


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


__all__ = ["add_renamed_flag", "parse_knobs", "parse_token_drop", "parse_token_drop_knobs",
           "parse_token_drop_option", "token_drop_config"]
