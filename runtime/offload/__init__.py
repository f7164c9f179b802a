"""KV offloading in the runtime: which pages move to the host and when (``policy``), and the
staged prefill that copies a sequence's host pages back to the GPU a layer ahead (``staging``).
The kernels that read host pages in place and the page copies are plugins/kv_offload.py; the
page tables (entries < 0 name host pages) are runtime/kv_cache.py's. The scheduler knows only
that a group has a host pool of some size (KVGroupSpec.offload)."""
