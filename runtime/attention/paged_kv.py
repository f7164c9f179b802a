"""PagedKV, the one object every attention backend reads (``layer.kv``), lives with the plugins
that take it (plugins/paged_kv.py: plugins do not import the runtime); re-exported here."""

from infhip.plugins.paged_kv import PagedKV

__all__ = ["PagedKV"]
