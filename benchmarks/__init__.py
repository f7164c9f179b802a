"""infhip's benchmarks and diagnostics, by subject (not installed: run from the repository root).

    python -m benchmarks.speed.bench_decode_e2e --help     # one benchmark
    bash benchmarks/gpu/run.sh                             # the GPU calls' suites, one line each

Subpackages: speed (timing), quality (recall, needle, RULER and perplexity probes), parity (the
authors' code beside ours), peers (vLLM side by side), gpu (the GPU-call runner, the smoke call,
staging). benchmarks/README.md says more.
"""
