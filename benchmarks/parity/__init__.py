"""Parity with the authors' code: InfiniteHiP (hip-attention v1_2, hip_attn_ref.py) and UniPrefill,
beside our engine on the same prompts."""
