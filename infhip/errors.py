"""The one exception type of the builder and the exporters (infhip-build, infhip-export-triton) that
is the user's to fix.

`infhip-build` prints a ``BuildError`` as a single line (no traceback) and exits non-zero; anything
else escaping the builder is a bug in infhip and keeps its traceback. Every message names the file
or value at fault and what to do about it.
"""

from __future__ import annotations


class BuildError(Exception):
    """A missing or damaged checkpoint, an unsupported architecture, a bad flag value, ..."""
