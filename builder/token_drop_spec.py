"""``--token-drop`` spec strings -> :class:`~infhip.config.TokenDropConfig`.

    ""                                  the defaults (p=0.99, n=128, G=64, A=128, min_len=8192)
    "p=0.98,G=32"                       override some knobs
    "p=1,min_len=0,rho=0.3"             forced retention (benchmarks), drop from any length

Keys: p, n (obs_window), G (block_size), A (num_sink), min_len (min_prompt_len),
rho (retention), spare (spare_anchors: the first that many anchors do not drop); the long names
are accepted too.

    >>> parse_token_drop("p=0.98,G=32").block_size
    32
"""

from __future__ import annotations

from typing import Any

from infhip.config import TokenDropConfig

_ALIASES = {"p": "p", "n": "obs_window", "obs_window": "obs_window", "G": "block_size",
            "g": "block_size", "block_size": "block_size", "A": "num_sink", "a": "num_sink",
            "num_sink": "num_sink", "min_len": "min_prompt_len", "min_prompt_len": "min_prompt_len",
            "rho": "retention", "retention": "retention", "spare": "spare_anchors",
            "spare_anchors": "spare_anchors"}
_FLOATS = ("p", "retention")
_KEYS_HELP = "p, n, G, A, min_len, rho, spare"


def parse_token_drop(text: str) -> TokenDropConfig:
    """Parse ``key=value,...`` (empty: defaults). Raises ValueError with a one-line fix."""
    return TokenDropConfig(**parse_token_drop_knobs(text))  # range checks there, one line each


def parse_token_drop_knobs(text: str) -> dict[str, Any]:
    """``key=value,...`` -> {field name: typed value} of the given keys only (to lay over an
    engine's own knobs: ``LLM(..., token_drop=knobs)``). Raises ValueError with a one-line fix."""
    knobs: dict[str, Any] = {}
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not value:
            raise ValueError(f"--token-drop item {item!r} is not key=value (keys: {_KEYS_HELP}), "
                             "e.g. --token-drop p=0.98,G=32")
        name = _ALIASES.get(key)
        if name is None:
            raise ValueError(f"--token-drop: unknown key {key!r}; keys: {_KEYS_HELP}")
        if name in knobs:
            raise ValueError(f"--token-drop: {key!r} given twice")
        try:
            knobs[name] = float(value) if name in _FLOATS else int(value)
        except ValueError:
            kind = "a number" if name in _FLOATS else "an integer"
            raise ValueError(f"--token-drop: {key}={value!r} must be {kind}") from None
    TokenDropConfig(**knobs)  # range checks, one line each
    return knobs


def long_names(knobs: dict[str, Any]) -> dict[str, Any]:
    """Knob dict with short keys (p, n, G, A, min_len, rho, spare) mapped to field names."""
    return {_ALIASES.get(k, k): v for k, v in knobs.items()}


def token_drop_config(value: "TokenDropConfig | dict | str | bool | None") -> TokenDropConfig | None:
    """Normalise the forms accepted by build_engine / LLM: None/False = off, True = defaults,
    a spec string, a dict of knobs (long names) or a TokenDropConfig."""
    if value is None or value is False:
        return None
    if value is True:
        return TokenDropConfig()
    if isinstance(value, TokenDropConfig):
        return value
    if isinstance(value, str):
        return parse_token_drop(value)
    if isinstance(value, dict):
        return TokenDropConfig().replace(**long_names(value))
    raise TypeError(f"token_drop must be None, a bool, a spec string, a dict or a TokenDropConfig; "
                    f"got {type(value).__name__}")


__all__ = ["long_names", "parse_token_drop", "parse_token_drop_knobs", "token_drop_config"]
