"""infhip beside other engines: vLLM 0.20.0 (bench_vs_vllm.py, its two sides and client) and the
wheels vLLM needs on the GPU machine (vllm_wheels.py)."""
