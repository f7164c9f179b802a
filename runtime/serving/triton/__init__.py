"""Serving an engine from NVIDIA Triton Inference Server (docs/serving_triton.md):

- `model`: the Python-backend model (`TritonPythonModel`), copied verbatim into a model repository
  as ``<repo>/<model>/1/model.py``; it drives the same `EngineLoop` as infhip-serve;
- `export`: ``infhip-export-triton``, an engine -> a model repository entry (config.pbtxt + model.py);
- `launch`: runs the tritonserver that the nvidia-pytriton wheel bundles, with infhip's drain.
"""
