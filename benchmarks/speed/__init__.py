"""Timing: whole-engine and one-layer benchmarks (decode, prefill/TTFT, offload, prefix caching,
serving, sampling, TP) and their shared helpers (timing.py, one_layer.py)."""
