"""``infhip-export-triton``: an engine -> a Triton Inference Server model repository entry.

    infhip-export-triton --engine engines/smollm2-135m --repo triton_repo
    tritonserver --model-repository triton_repo        # see docs/serving_triton.md (CPU: nvidia-pytriton)
    curl localhost:8000/v2/models/smollm2-135m/generate -d '{"text_input": "Hi", "max_tokens": 8}'

    >>> from infhip.runtime.serving.triton.export import export_triton_repo
    >>> export_triton_repo("engines/smollm2-135m", "triton_repo")     # doctest: +SKIP
    PosixPath('triton_repo/smollm2-135m')

Writes ``<repo>/<model>/config.pbtxt`` and ``<repo>/<model>/1/model.py`` (a copy of
`infhip.runtime.serving.triton.model`, served by Triton's Python backend). The engine is not copied:
config.pbtxt names its absolute path (``parameters.engine_dir``), so the repository is small and
the engine must stay where it is. The model is decoupled by default (streaming; Triton's
``/generate_stream`` and gRPC streams), batching happens inside the engine (Triton's
``max_batch_size`` is 0; ``parameters.max_num_seqs`` caps the engine's batch), and one model
instance owns the engine.

The model folder is written beside its destination (``<repo>/.<model>.tmp-XXXX``) and renamed
into place when complete; an existing model is replaced only with ``force=True`` and only after
the new one is complete. User errors raise `BuildError` (one line from the CLI, exit status 1).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import site
import sys
import tempfile
from pathlib import Path

from infhip.cli_args import positive_int
from infhip.output_dir import install_dir
from infhip.errors import BuildError

_MODEL_SOURCE = Path(__file__).with_name("model.py")
# Triton model names are folder names (and URL path segments): keep them plain.
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")


def _pbtxt_string(s: str) -> str:
    if any(ord(c) < 0x20 for c in s):
        raise BuildError(f"{s!r} holds control characters, which config.pbtxt cannot carry; rename it")
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _tensors(kind: str, specs, optional: bool) -> str:
    lines = []
    for i, (name, dtype, dims, what) in enumerate(specs):
        opt = " optional: true" if optional else ""
        comma = "," if i < len(specs) - 1 else ""
        lines.append(f"  {{ name: \"{name}\" data_type: {dtype} dims: [ {', '.join(map(str, dims))} ]{opt} }}{comma}"
                     f"  # {what}\n")
    return f"{kind} [\n" + "".join(lines) + "]\n"


def _parameters_comment(specs) -> str:
    """The request parameters the model reads, as comment lines (config.pbtxt cannot declare them)."""
    return ("# Request parameters (the generate endpoint makes every JSON field that is not an input one;\n"
            "# gRPC and /infer clients set them in the request's parameters); any other is an error:\n"
            + "".join(f"#   {name} ({kind}): {what}\n" for name, kind, what in specs))


def render_config(model_name: str, params: dict[str, str], decoupled: bool) -> str:
    """config.pbtxt of the model (protobuf text format of Triton's ModelConfig). Every input is
    optional: the model checks that exactly one of text_input / input_ids is given."""
    from infhip import __version__
    from infhip.runtime.serving.triton.model import INPUTS, OUTPUTS, PARAMETERS

    head = (f"# An infhip engine served by Triton's Python backend (1/model.py); written by "
            f"infhip-export-triton {__version__}.\n"
            f"name: {_pbtxt_string(model_name)}\n"
            "backend: \"python\"\n"
            "# The engine batches requests itself (continuous batching, up to parameters.max_num_seqs).\n"
            "max_batch_size: 0\n"
            f"model_transaction_policy {{ decoupled: {'true' if decoupled else 'false'} }}\n"
            "# One instance: it owns the engine (and the GPU memory of its KV cache).\n"
            "instance_group [ { count: 1 kind: KIND_MODEL } ]\n")
    body = (_tensors("input", INPUTS, optional=True) + _parameters_comment(PARAMETERS)
            + _tensors("output", OUTPUTS, optional=False))
    tail = "".join(f"parameters {{ key: \"{k}\" value: {{ string_value: {_pbtxt_string(v)} }} }}\n"
                   for k, v in params.items())
    return head + body + tail


def _check_destination(out: Path, force: bool) -> None:
    if not out.exists():
        return
    if not force:
        raise BuildError(f"{out} already exists; pass --force to replace it")
    if not out.is_dir() or not (out / "config.pbtxt").is_file():
        raise BuildError(f"refusing to replace {out}: it is not a Triton model folder (no config.pbtxt); "
                         "remove it or choose another --model-name")


def export_triton_repo(engine_dir: str | os.PathLike, repo_dir: str | os.PathLike, model_name: str | None = None,
                       max_batch_size: int | None = None, decoupled: bool = True, device: str | None = None,
                       force: bool = False) -> Path:
    """Write the Triton model for the engine at engine_dir into repo_dir; return its folder.

    model_name: the Triton model name (default: the engine folder's name).
    max_batch_size: most sequences the engine steps at once (LLM's max_num_seqs; default the
        engine's build max_batch_size, which is also the most it accepts).
    decoupled: streaming responses (True) or one response per request (False: /infer works too).
    device: "cpu" / "cuda" for the engine; default its build target.
    """
    from infhip.config import EngineConfig, EngineFormatError

    # Triton runs from elsewhere: the path must be absolute (symlinks kept: a link to the current
    # engine lets a rebuild be served by reloading the model)
    engine = Path(os.path.abspath(engine_dir))
    try:
        config = EngineConfig.load(engine)
    except EngineFormatError as e:
        raise BuildError(str(e)) from e
    name = engine.name if model_name is None else model_name
    if not _NAME.fullmatch(name):
        raise BuildError(f"model name {name!r} is not a valid Triton model name (letters, digits, _ . -; "
                         "at most 128, not starting with . or -); pass --model-name NAME")
    limit = config.build.max_batch_size
    if max_batch_size is None:
        max_batch_size = limit
    elif isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or not 1 <= max_batch_size <= limit:
        raise BuildError(f"max batch size must be an int in [1, {limit}] (the engine was built for {limit}), "
                         f"got {max_batch_size!r}")
    if device not in (None, "cpu", "cuda"):
        raise BuildError(f"device must be cpu or cuda (or omitted for the engine's target), got {device!r}")
    repo = Path(repo_dir)
    if repo.exists() and not repo.is_dir():
        raise BuildError(f"{repo} exists and is not a directory; choose another --repo")
    out = repo / name
    _check_destination(out, force)

    params = {"engine_dir": str(engine), "max_num_seqs": str(max_batch_size)}
    if device is not None:
        params["device"] = device
    params["python_site_dirs"] = os.pathsep.join(site.getsitepackages())  # where infhip is installed
    text = render_config(name, params, decoupled)

    repo.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=repo))
    try:
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o777 & ~mask)  # mkdtemp makes it 0700; the model is a normal folder
        (tmp / "config.pbtxt").write_text(text)
        (tmp / "1").mkdir()
        shutil.copyfile(_MODEL_SOURCE, tmp / "1" / "model.py")
        install_dir(tmp, out, lambda o: _check_destination(o, force))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="infhip-export-triton",
                                description="Export an infhip engine as a Triton Inference Server model "
                                            "(Python backend, streaming).")
    p.add_argument("--engine", required=True, metavar="DIR", help="engine directory written by infhip-build")
    p.add_argument("--repo", required=True, metavar="DIR", help="Triton model repository (created if missing)")
    p.add_argument("--model-name", metavar="NAME", help="Triton model name (default: the engine folder's name)")
    p.add_argument("--max-batch-size", type=positive_int, metavar="N",
                   help="most sequences batched at once (default and maximum: the engine's max batch size)")
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: the engine's target")
    p.add_argument("--no-decoupled", action="store_true",
                   help="one response per request (no streaming; /v2/models/NAME/infer works)")
    p.add_argument("--force", action="store_true", help="replace an existing model of that name")
    args = p.parse_args(argv)
    try:
        out = export_triton_repo(args.engine, args.repo, model_name=args.model_name,
                                 max_batch_size=args.max_batch_size, decoupled=not args.no_decoupled,
                                 device=args.device, force=args.force)
    except (BuildError, OSError) as e:
        print(f"infhip-export-triton: error: {e}", file=sys.stderr)
        return 1
    print(f"Triton model written to {out} (engine {os.path.abspath(args.engine)}); serve it with: "
          f"tritonserver --model-repository {out.parent}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
