"""Stage a built engine, or any large file (a GGUF), for the GPU machine, which receives at most
64 MiB per call.

The real-model engines are larger (SmolLM2-135M: 269 MiB in bf16, 517 MiB in fp32; Gemma-3-270M:
~540 MiB bf16), so `split` cuts `rank0.safetensors` into parts of at most 60 MiB inside the
git-ignored `.stage/<name>/`, next to a manifest with the SHA-256 of every part and of the whole
file, and a copy of the engine's small files (config, tokenizer, kernels, report). Each part
then travels in its own device call (`carry` names the path; the machine keeps ignored files
between calls while it stays warm); the last call runs `join`, which checks every checksum and
rebuilds the engine directory there.

    python -m infhip.eval.stage split engines/smollm2-135m          # -> .stage/smollm2-135m/
    python -m infhip.eval.stage status .stage/smollm2-135m          # parts present / missing
    python -m infhip.eval.stage join .stage/smollm2-135m engines/smollm2-135m   # on the GPU side

A single file goes the same way, without the engine's small files (a GGUF that the GPU machine
builds its engines from is half the size of a bf16 engine):

    python -m infhip.eval.stage split-file ~/.cache/infhip/x.gguf --name x       # -> .stage/x/
    python -m infhip.eval.stage join-file .stage/x /tmp/cache/x.gguf              # on the GPU side

    >>> from infhip.eval.stage import split_engine, join_engine     # doctest: +SKIP
    >>> stage = split_engine("engines/smollm2-135m", part_mib=60)  # doctest: +SKIP
    >>> join_engine(stage, "/tmp/engine")                            # verifies SHA-256, then writes  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

WEIGHTS = "rank0.safetensors"
MANIFEST = "manifest.json"
MiB = 1 << 20
MAX_PART_MIB = 60  # under the 64 MiB a device call carries, leaving room for the working tree


class StageError(RuntimeError):
    """A stage folder that is incomplete or corrupt, or bad arguments."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(4 * MiB), b""):
            h.update(block)
    return h.hexdigest()


def split_engine(engine_dir: str | Path, stage_root: str | Path = ".stage", part_mib: float = MAX_PART_MIB) -> Path:
    """Write `<stage_root>/<engine name>/` (parts, small files, manifest); returns that folder."""
    engine = Path(engine_dir)
    weights = engine / WEIGHTS
    if not weights.is_file():
        raise StageError(f"{weights} not found: is {engine} an engine directory?")
    if not 0 < part_mib <= MAX_PART_MIB:
        raise StageError(f"part size must be in (0, {MAX_PART_MIB}] MiB, got {part_mib}")
    stage = _fresh_stage(Path(stage_root) / engine.resolve().name)
    shutil.copytree(engine, stage / "engine", ignore=shutil.ignore_patterns(WEIGHTS))
    manifest = {"engine": engine.resolve().name, "weights": WEIGHTS, "bytes": weights.stat().st_size,
                "sha256": _sha256(weights), "parts": _write_parts(weights, stage, part_mib)}
    (stage / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return stage


def split_file(path: str | Path, name: str, stage_root: str | Path = ".stage", part_mib: float = MAX_PART_MIB) -> Path:
    """Write `<stage_root>/<name>/` with the parts of one file and a manifest; returns that folder."""
    src = Path(path)
    if not src.is_file():
        raise StageError(f"{src} is not a file")
    if not 0 < part_mib <= MAX_PART_MIB:
        raise StageError(f"part size must be in (0, {MAX_PART_MIB}] MiB, got {part_mib}")
    stage = _fresh_stage(Path(stage_root) / name)
    manifest = {"file": src.name, "bytes": src.stat().st_size, "sha256": _sha256(src),
                "parts": _write_parts(src, stage, part_mib)}
    (stage / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return stage


def _fresh_stage(stage: Path) -> Path:
    if stage.exists():
        shutil.rmtree(stage)
    (stage / "parts").mkdir(parents=True)
    return stage


def _write_parts(src: Path, stage: Path, part_mib: float) -> list[dict]:
    """Cut `src` into stage/parts/<name>.NNN of part_mib MiB; their manifest entries."""
    part_bytes, parts = int(part_mib * MiB), []
    with open(src, "rb") as f:
        for i in range(10**6):
            data = f.read(part_bytes)
            if not data:
                break
            name = f"parts/{src.name}.{i:03d}"
            (stage / name).write_bytes(data)
            parts.append({"path": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    return parts


def stage_status(stage_dir: str | Path) -> tuple[list[str], list[str]]:
    """(parts present with a matching checksum, parts missing or corrupt)."""
    stage = Path(stage_dir)
    if not (stage / MANIFEST).is_file():
        raise StageError(f"{stage / MANIFEST} not found (run `split` first, and carry the manifest)")
    manifest = json.loads((stage / MANIFEST).read_text())
    ok, bad = [], []
    for p in manifest["parts"]:
        path = stage / p["path"]
        good = path.is_file() and path.stat().st_size == p["bytes"] and _sha256(path) == p["sha256"]
        (ok if good else bad).append(p["path"])
    return ok, bad


def _checked_manifest(stage: Path) -> dict:
    ok, bad = stage_status(stage)
    if bad:
        raise StageError(f"{len(bad)} part(s) missing or corrupt: {', '.join(bad)}")
    return json.loads((stage / MANIFEST).read_text())


def _concat(stage: Path, manifest: dict, dest: Path) -> None:
    """Write the parts in order to `dest`; StageError if the whole does not match the manifest."""
    with open(dest, "wb") as f:
        for p in manifest["parts"]:
            f.write((stage / p["path"]).read_bytes())
    if _sha256(dest) != manifest["sha256"]:
        raise StageError("reassembled file does not match the manifest's SHA-256")


def join_engine(stage_dir: str | Path, output_dir: str | Path) -> Path:
    """Check every part, concatenate, check the whole file, then put the engine at `output_dir`."""
    stage, out = Path(stage_dir), Path(output_dir)
    manifest = _checked_manifest(stage)
    tmp = out.with_name(out.name + ".joining")
    if tmp.exists():
        shutil.rmtree(tmp)
    shutil.copytree(stage / "engine", tmp)
    try:
        _concat(stage, manifest, tmp / WEIGHTS)
    except StageError:
        shutil.rmtree(tmp)
        raise
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)  # atomic: a half-joined engine never sits at `out`
    return out


def join_file(stage_dir: str | Path, output: str | Path) -> Path:
    """Check every part, concatenate them to `output` (atomically), check the whole file."""
    stage, out = Path(stage_dir), Path(output)
    manifest = _checked_manifest(stage)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.joining")
    try:
        _concat(stage, manifest, tmp)
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m infhip.eval.stage", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("split", help="cut an engine's weights into <= 60 MiB parts under .stage/")
    s.add_argument("engine")
    s.add_argument("--stage-root", default=".stage")
    s.add_argument("--part-mib", type=float, default=MAX_PART_MIB)
    st = sub.add_parser("status", help="which parts are present and intact")
    st.add_argument("stage")
    j = sub.add_parser("join", help="verify the parts and rebuild the engine directory")
    j.add_argument("stage")
    j.add_argument("output")
    sf = sub.add_parser("split-file", help="cut one file into <= 60 MiB parts under .stage/NAME")
    sf.add_argument("file")
    sf.add_argument("--name", required=True, help="the stage folder's name")
    sf.add_argument("--stage-root", default=".stage")
    sf.add_argument("--part-mib", type=float, default=MAX_PART_MIB)
    jf = sub.add_parser("join-file", help="verify the parts and write the file")
    jf.add_argument("stage")
    jf.add_argument("output")
    args = p.parse_args(argv)
    try:
        if args.cmd == "split":
            stage = split_engine(args.engine, args.stage_root, args.part_mib)
            parts = json.loads((stage / MANIFEST).read_text())["parts"]
            print(f"{stage}: {len(parts)} parts; carry one per device call:")
            for part in parts:
                print(f"  {stage / part['path']}")
            print(f"  (first call also: {stage / MANIFEST} and {stage / 'engine'})")
        elif args.cmd == "split-file":
            stage = split_file(args.file, args.name, args.stage_root, args.part_mib)
            parts = json.loads((stage / MANIFEST).read_text())["parts"]
            print(f"{stage}: {len(parts)} parts; carry one per device call (the first with {stage / MANIFEST}):")
            for part in parts:
                print(f"  {stage / part['path']}")
        elif args.cmd == "join-file":
            print(f"file joined at {join_file(args.stage, args.output)}")
        elif args.cmd == "status":
            ok, bad = stage_status(args.stage)
            print(f"{len(ok)} parts ok, {len(bad)} missing or corrupt" + (": " + ", ".join(bad) if bad else ""))
            return 0 if not bad else 1
        else:
            print(f"engine joined at {join_engine(args.stage, args.output)}")
    except StageError as e:
        print(f"stage: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
