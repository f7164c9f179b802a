"""A registry of classes by their ``name``, whose built-in members register themselves on import:
the plan methods' (infhip/methods/), the attention backends' (runtime/attention/backend.py) and the
step transforms' (runtime/step_transform.py). Torch-free: the builder and the runtime both use it."""

from __future__ import annotations

import importlib
from typing import Callable


class Registry:
    """``kind`` names a member in errors ("an attention backend"); ``builtin`` are the modules
    that register the built-in members on import (or a function that lists them), loaded on first
    use, so that they come first whoever registers first."""

    def __init__(self, kind: str, builtin: tuple[str, ...] | Callable[[], tuple[str, ...]]):
        self.kind, self._builtin = kind, builtin
        self._classes: dict[str, type] = {}
        self._loaded = False

    @property
    def builtin(self) -> tuple[str, ...]:
        """The built-in modules (a callable given: asked once, e.g. the built-in methods' runtime modules)."""
        if callable(self._builtin):
            self._builtin = tuple(self._builtin())
        return self._builtin

    def _load_builtins(self) -> None:
        # once; a built-in module being imported (the one whose registration called this) is left
        # to finish its import
        if not self._loaded:
            self._loaded = True
            for module in self.builtin:
                importlib.import_module(module)

    def register(self, cls: type) -> type:
        """Register a class under its ``name`` (a decorator); a second one of a name raises."""
        self._load_builtins()
        if self._classes.get(cls.name, cls) is not cls:
            raise ValueError(f"{self.kind} named {cls.name!r} is already registered")
        self._classes[cls.name] = cls
        return cls

    def unregister(self, name: str) -> None:
        """Remove a registered class (tests)."""
        self._classes.pop(name, None)

    def classes(self) -> list[type]:
        """The registered classes: the built-in ones in ``builtin``'s order (whichever was imported
        first), then the others in registration order."""
        self._load_builtins()
        rank = {module: i for i, module in enumerate(self.builtin)}
        return sorted(self._classes.values(), key=lambda cls: rank.get(cls.__module__, len(rank)))

    def get(self, name: str) -> type | None:
        """The class registered under ``name``, None: none is."""
        self._load_builtins()
        return self._classes.get(name)
