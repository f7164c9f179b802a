"""infhip-bench (runtime/bench/cli.py): latency, throughput, serve and long-context benchmarks
for a user's own engine and GPU, installed with the package. offline.py runs an `LLM`
in-process, serve.py is a small OpenAI-compatible client, stats.py prints and writes results.
The GPU scripts of benchmarks/speed/ reuse these loops."""
