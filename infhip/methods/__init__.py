"""The plan methods: every attention backend's and step transform's side of the engine format,
by registered name (method.py says what a method declares). Built in, one folder each: InfiniteHiP
(infinitehip/, an attention backend) and UniPrefill token drop (token_drop/, a step transform)."""

from infhip.methods.method import (BACKEND, TRANSFORM, Method, by_keyword, knob, method, methods, presets,
                                   register, renamed_flags, require, runtime_modules, unregister)

__all__ = ["BACKEND", "TRANSFORM", "Method", "by_keyword", "knob", "method", "methods", "presets", "register",
           "renamed_flags", "require", "runtime_modules", "unregister"]
