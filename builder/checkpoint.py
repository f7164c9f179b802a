"""Checkpoint readers: a HF config dict, HF-named tensors one at a time, and the tokenizer.

Three sources, one interface (:class:`Checkpoint`):

* a Hugging Face model directory: ``config.json`` + ``model.safetensors`` or shards listed in
  ``model.safetensors.index.json`` (memory-mapped via ``safe_open``: an 8B model never sits in
  RAM twice);
* a ``.gguf`` file: transformers' GGUF reader supplies the config, the tokenizer and the
  HF-name mapping; each tensor is dequantised only when asked for (with llama.cpp's q/k
  permutation and Gemma's ``w + 1`` norms undone exactly as ``from_pretrained`` does);
* a bare ``config.json`` (no weights): only for ``--random-weights``.

Tensor names are the text decoder's HF names with the wrapper prefixes stripped:
``model.layers.0.self_attn.q_proj.weight`` -> ``layers.0.self_attn.q_proj.weight``; the
``language_model`` of a multimodal Gemma-3 checkpoint maps to the same names.

    >>> ckpt = open_checkpoint("path/to/hf_dir")          # doctest: +SKIP
    >>> ckpt.config["model_type"], ckpt.get("embed_tokens.weight").shape   # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import functools
import json
from pathlib import Path
from typing import Any

import torch

from infhip.errors import BuildError

# Longest first: multimodal wrappers (old and new transformers layouts), then plain "model.".
_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")


def text_decoder_name(name: str) -> str:
    """HF parameter name -> the text decoder's name without wrapper prefixes."""
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise BuildError(
            f"{path} not found: a checkpoint directory needs the model's config.json "
            "(download the whole Hugging Face repo, not just the weights)")
    try:
        d = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BuildError(f"{path} is not valid JSON ({e}); re-download it") from e
    if not isinstance(d, dict):
        raise BuildError(f"{path} is not a JSON object; is it a Hugging Face config.json?")
    return d


class Checkpoint:
    """Base: ``config`` (HF dict), ``names()``, ``get(name)``, ``load_tokenizer()``."""

    description: str = ""
    config: dict[str, Any]
    has_weights: bool = True
    notes: tuple[str, ...] = ()  # what the reader had to adjust or could not honour (-> build report)

    def names(self) -> list[str]:
        raise NotImplementedError

    def get(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def load_tokenizer(self):
        """The source's transformers tokenizer, or None when it has none."""
        return None

    def close(self) -> None:
        pass


class ConfigOnlyCheckpoint(Checkpoint):
    """A config.json without weights (the bundled model_configs/): random-weights builds only."""

    has_weights = False

    def __init__(self, config_path: Path, description: str | None = None):
        self.config = _read_config(config_path)
        self.description = description or str(config_path)

    def names(self) -> list[str]:
        return []

    def get(self, name: str) -> torch.Tensor:
        raise BuildError(f"{self.description} has no weights; build it with --random-weights")


class HFDirCheckpoint(Checkpoint):
    """``config.json`` + safetensors (single file or sharded with an index)."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        self.path = path
        self.description = str(path)
        self.config = _read_config(path / "config.json")
        shard_of = self._shard_map(path)  # original name -> shard file name
        self._handles: dict[str, Any] = {}
        for shard in sorted(set(shard_of.values())):
            f = path / shard
            if not f.is_file():
                raise BuildError(f"{f} is missing (listed in model.safetensors.index.json); re-download the checkpoint")
            try:
                self._handles[shard] = safe_open(str(f), framework="pt", device="cpu")
            except Exception as e:  # SafetensorError is not importable under a stable name
                raise BuildError(f"{f} is not a valid safetensors file ({e}); re-download it") from e
        self._where: dict[str, tuple[str, str]] = {}  # our HF name -> (shard, original name)
        for shard, h in self._handles.items():
            keys = set(h.keys())
            listed = [n for n, s in shard_of.items() if s == shard]
            absent = [n for n in listed if n not in keys]
            if absent:
                raise BuildError(
                    f"{path / shard} lacks {len(absent)} tensor(s) that model.safetensors.index.json "
                    f"places there (e.g. {absent[0]}); the download is incomplete or mixed: re-download it")
            for orig in sorted(keys):
                name = text_decoder_name(orig)
                if name in self._where:
                    raise BuildError(f"{path}: tensors {orig} and {self._where[name][1]} both map to {name}")
                self._where[name] = (shard, orig)

    @staticmethod
    def _shard_map(path: Path) -> dict[str, str]:
        index = path / "model.safetensors.index.json"
        if index.is_file():
            try:
                return dict(json.loads(index.read_text())["weight_map"])
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise BuildError(f"{index} is damaged ({e}); re-download it") from e
        files = sorted(p.name for p in path.glob("*.safetensors"))
        if not files:
            pickled = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt*"))
            hint = (f" (found {pickled[0]}: pickle checkpoints are not read; re-save with "
                    "model.save_pretrained(dir) which writes safetensors)") if pickled else ""
            raise BuildError(f"{path} has no *.safetensors weights{hint}; or pass --random-weights "
                             "to build from its config alone")
        from safetensors import safe_open
        out = {}
        for name in files:
            try:
                with safe_open(str(path / name), framework="pt", device="cpu") as h:
                    out.update({k: name for k in h.keys()})
            except Exception as e:
                raise BuildError(f"{path / name} is not a valid safetensors file ({e}); re-download it") from e
        return out

    def names(self) -> list[str]:
        return list(self._where)

    def get(self, name: str) -> torch.Tensor:
        shard, orig = self._where[name]
        try:
            return self._handles[shard].get_tensor(orig)
        except Exception as e:
            raise BuildError(f"{self.path / shard}: cannot read {orig} ({e}); re-download it") from e

    def load_tokenizer(self):
        if not any((self.path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
            return None
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(str(self.path))

    def close(self) -> None:
        self._handles.clear()  # safe_open handles unmap when collected


class GGUFCheckpoint(Checkpoint):
    """A llama.cpp GGUF file, dequantised tensor by tensor through transformers' GGUF utilities."""

    def __init__(self, path: Path):
        self.path = path
        self.description = str(path)
        try:
            import gguf  # noqa: F401  (transformers needs it; say so before it fails obscurely)
        except ImportError as e:
            raise BuildError("reading .gguf files needs the gguf package: pip install gguf accelerate") from e
        from transformers.modeling_gguf_pytorch_utils import (
            TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map, load_gguf_checkpoint, read_field)
        from infhip.builder.gguf_reader import open_gguf

        try:
            self._reader = open_gguf(path)
            with self._shared_reader():
                self.config = dict(load_gguf_checkpoint(str(path), return_tensors=False)["config"])
        except (ValueError, KeyError, IndexError, OSError) as e:
            raise BuildError(f"{path} is not a readable GGUF file ({e}); re-download it") from e
        self.config.pop("_model_name_or_path", None)
        architecture = read_field(self._reader, "general.architecture")[0]
        self.notes = tuple(_complete_gguf_config(self.config, self._reader, architecture))
        self._processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=self.config)
        with self._shared_reader():
            self._mapping = get_gguf_hf_weights_map(self._meta_model(), self._processor)
        self._tensors = {t.name: t for t in self._reader.tensors}
        self._where = {text_decoder_name(self._mapping[n]): n for n in self._tensors if n in self._mapping}

    @contextlib.contextmanager
    def _shared_reader(self):
        """Speed only, same results: transformers' GGUF helpers re-parse the file on every call
        (with gguf's own reader: ~7 s for SmolLM2's 49K-token vocabulary, ~16 s for Gemma-3's 262K)
        and rebuild gguf's tensor-name map once per module (~4.5 s). They import both from ``gguf``
        at call time, so for the duration we hand them our parsed reader (gguf_reader.py: the same
        fields, parsed faster) and a memoised name map."""
        import gguf

        saved = gguf.GGUFReader, gguf.get_tensor_name_map
        reader = self._reader
        gguf.GGUFReader = lambda *args, **kwargs: reader
        gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(saved[1])
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = saved

    def _meta_model(self) -> torch.nn.Module:
        # The GGUF -> HF name map is derived from a model's state_dict; a meta model costs no memory.
        from transformers import AutoModelForCausalLM
        from infhip.builder.hf_config import hf_config_object
        cfg = hf_config_object(self.config, str(self.path))
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(cfg)

    def names(self) -> list[str]:
        return list(self._where)

    def get(self, name: str) -> torch.Tensor:
        import numpy as np
        from gguf import dequantize

        t = self._tensors[self._where[name]]
        try:
            weights = dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise BuildError(f"{self.path}: cannot dequantise {t.name} ({e}); re-download it") from e
        result = self._processor.process(weights=weights, name=t.name, tensor_key_mapping=self._mapping,
                                         parsed_parameters={"config": self.config, "tensors": {}})
        return torch.from_numpy(np.array(result.weights, copy=True))

    def load_tokenizer(self):
        from transformers import AutoTokenizer
        from infhip.builder.spm_tokenizer import sentencepiece_bpe_from_gguf
        if "tokenizer.ggml.tokens" not in self._reader.fields:
            return None
        # SentencePiece-BPE vocabularies (Gemma): transformers' conversion mis-tokenizes them.
        tok = sentencepiece_bpe_from_gguf(self._reader)
        if tok is None:
            with self._shared_reader():
                tok = AutoTokenizer.from_pretrained(str(self.path.parent), gguf_file=self.path.name)
        # transformers' GGUF tokenizer conversion can pick the wrong special tokens (SmolLM2:
        # eos = <|im_start|>); the file's own metadata ids are the truth.
        for attr in ("bos_token", "eos_token"):
            want = self.config.get(f"{attr}_id")
            if isinstance(want, int) and 0 <= want < len(tok) and getattr(tok, f"{attr}_id") != want:
                setattr(tok, attr, tok.convert_ids_to_tokens(want))
        return tok


def _complete_gguf_config(config: dict[str, Any], reader, arch: str) -> list[str]:
    """Fill in what transformers' GGUF config mapping drops but llama.cpp models depend on;
    returns notes for the build report."""
    from transformers.modeling_gguf_pytorch_utils import read_field

    notes = []
    kind = (read_field(reader, f"{arch}.rope.scaling.type") or [None])[0]
    factor = (read_field(reader, f"{arch}.rope.scaling.factor") or [None])[0]
    if kind in ("linear", "yarn") and factor and "rope_scaling" not in config:
        scaling = {"rope_type": kind, "factor": float(factor)}
        original = (read_field(reader, f"{arch}.rope.scaling.original_context_length") or [None])[0]
        if kind == "yarn" and original:
            scaling["original_max_position_embeddings"] = int(original)
        config["rope_scaling"] = scaling
        notes.append(f"RoPE scaling {scaling} taken from the GGUF metadata (transformers' GGUF reader ignores it)")
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        notes.append("the GGUF's rope_freqs.weight (llama3 RoPE scaling) is ignored, as transformers does: "
                     "use the original Hugging Face checkpoint for exact long-context RoPE")
    if config.get("model_type") == "gemma3_text" and config.get("num_hidden_layers") == 62:
        # Gemma-3-27B scales queries by (hidden/heads)**-0.5 = 168**-0.5, not head_dim**-0.5
        # (llama.cpp keys this on the 27B layer count too); GGUF has no field for it.
        config["query_pre_attn_scalar"] = config["hidden_size"] // config["num_attention_heads"]
        notes.append(f"query_pre_attn_scalar set to {config['query_pre_attn_scalar']} (Gemma-3-27B)")
    return notes


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Open a HF directory, a .gguf file, or a bare config .json (random weights only)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise BuildError(f"checkpoint {path} does not exist; pass a Hugging Face model directory, a .gguf file, "
                         "or --model NAME")
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").exists() and len(ggufs) == 1:
            return GGUFCheckpoint(ggufs[0])
        return HFDirCheckpoint(path)
    if path.suffix == ".gguf":
        return GGUFCheckpoint(path)
    if path.suffix == ".json":
        return ConfigOnlyCheckpoint(path)
    raise BuildError(f"{path} is neither a checkpoint directory, a .gguf file nor a config .json")
