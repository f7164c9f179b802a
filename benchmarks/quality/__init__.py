"""Quality probes on real models: needle coverage, recall what-ifs, token-drop ablations and RULER
probes, fp8 sensitivity, the Qwen summary table, and engine replanning for layer bisection."""
