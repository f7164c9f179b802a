"""Which wheels vLLM needs on the H200 machine beyond what its image holds: resolve, check, install.

The GPU machine cannot reach a registry, so everything vLLM imports that its image lacks travels as
wheels (benchmarks/gpu/stage/vllm.sh packs and splits them). The closure is read from the wheels
themselves: start at `vllm==0.20.0`, read each wheel's Requires-Dist (markers evaluated for the
machine: CPython 3.12 on Linux x86-64, extras followed where a requirement names them), stop at any
name the machine already has (benchmarks/gpu/stage/machine_packages.txt), download the rest.

    python -m benchmarks.peers.vllm_wheels resolve --dir .whl/vllm     # here: download, write plan.json
    python -m benchmarks.peers.vllm_wheels check --dir .whl/vllm       # here, offline: the plan vs the wheels
    python3 -m benchmarks.peers.vllm_wheels install --dir D --target /tmp/site   # there: pip + check versions

`check` recomputes the closure from the downloaded wheels' metadata alone and fails (exit 1) on a
requirement no staged wheel or machine package meets, a staged wheel no requirement reaches, two
versions of one name, or a wheel whose tags the machine's Python cannot install. `install` runs
on the machine: it installs the plan's wheels with pip (offline, no deps) into --target and then
checks every requirement edge of the plan against the versions really importable there.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import zipfile
from collections import defaultdict
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

ROOT = "vllm==0.20.0"
HERE = Path(__file__).resolve().parent
MACHINE_LIST = HERE.parent / "gpu" / "stage" / "machine_packages.txt"
PLAN = "plan.json"
# The machine's Python and platform: what markers and wheel tags are evaluated against.
MARKER_ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
              "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
              "implementation_name": "cpython", "platform_python_implementation": "CPython",
              "platform_release": "", "platform_version": "", "implementation_version": "3.12.3"}
# glibc 2.39 is assumed (the image's Python 3.12.3 is Ubuntu 24.04's; not read there); the staged
# set needs 2.35 at most (vllm's manylinux_2_35), which --unpack's pip install proves or refutes.
GLIBC_MINOR = 39
PIP_PLATFORM = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"] + [
    a for n in (39, 35, 34, 31, 28, 27, 24, 17) for a in ("--platform", f"manylinux_2_{n}_x86_64")] + [
    "--platform", "manylinux2014_x86_64", "--platform", "manylinux1_x86_64"]
# Machine packages kept although a vLLM pin asks for another version, each with the reason.
KEEP_MACHINE = {
    "numba": "vLLM pins numba==0.65.0, which needs numpy<2.5 and refuses to import beside the "
             "machine's numpy 2.5.2; vLLM imports numba only for n-gram speculative decoding",
    "numpy": "every mistral-common >= 1.11 (vLLM's floor) asks numpy<2.4 on Python 3.12; a staged "
             "numpy 2.3 would shadow the 2.5.2 that the machine's torch, scipy and opencv were installed "
             "with, and vLLM needs mistral-common only for Mistral-format tokenizers",
}


class WheelError(RuntimeError):
    """A requirement nothing satisfies, a bad wheel directory, or a failed download."""


def machine_packages(path: Path = MACHINE_LIST) -> dict[str, Version | None]:
    """{canonical name: version or None (present, version not recorded)}."""
    out = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, *ver = line.split()
            out[canonicalize_name(name)] = Version(ver[0]) if ver else None
    return out


def wheel_meta(path: Path) -> tuple[str, Version, list[Requirement]]:
    """(canonical name, version, Requires-Dist) read from the wheel's METADATA."""
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        msg = Parser().parsestr(z.read(meta).decode())
    reqs = [Requirement(r) for r in msg.get_all("Requires-Dist") or []]
    return canonicalize_name(msg["Name"]), Version(msg["Version"]), reqs


def installable(path: Path) -> bool:
    """Whether the machine's CPython 3.12 on manylinux x86-64 (glibc 2.39) can install this wheel."""
    from packaging import tags
    platforms = [f"manylinux_2_{n}_x86_64" for n in range(GLIBC_MINOR, 4, -1)] + [
        "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"]
    supported = set(tags.cpython_tags((3, 12), platforms=platforms)) | set(
        tags.compatible_tags((3, 12), "cp312", platforms=platforms))
    return bool(parse_wheel_filename(path.name)[3] & supported)


def applies(req: Requirement, extra: str) -> bool:
    return req.marker is None or req.marker.evaluate({**MARKER_ENV, "extra": extra})


def walk(root: Requirement, machine: dict, find_wheel, excluded: dict | None = None) -> dict:
    """The closure from `root`. find_wheel(name, specifier) -> Path of a wheel meeting the specifier
    (downloading it if need be) or None; `excluded` {name: SpecifierSet} removes versions a conflict
    ruled out. Returns {"wheels": {name: Path}, "edges": [(parent, requirement, what meets it)],
    "conflicts": [(parent name, parent version, why)], "check_there": {name: [specifiers]}}."""
    specs: dict[str, SpecifierSet] = defaultdict(SpecifierSet)
    for name, spec in (excluded or {}).items():
        specs[name] &= spec
    wheels: dict[str, Path] = {}
    edges, conflicts, check_there = [], [], defaultdict(list)
    queue, seen = [(None, root, "")], set()
    while queue:
        parent, req, parent_extra = queue.pop(0)  # parent: (name, version, extra) or None for the root
        if not applies(req, parent_extra):
            continue
        name, who = canonicalize_name(req.name), _who(parent)
        if name in machine and (machine[name] is None or name in KEEP_MACHINE):
            if str(req.specifier):
                check_there[name].append((str(req.specifier), who))
            edges.append((who, str(req), "machine"))
            continue
        if name in machine and parent is not None and machine[name] not in req.specifier:
            # a newer machine version than this parent allows: try an older parent first (pip would)
            conflicts.append((parent[0], parent[1], f"{req} vs the machine's {name} {machine[name]}"))
            continue
        if name in machine and machine[name] in req.specifier:
            edges.append((who, str(req), f"machine {machine[name]}"))
            continue
        specs[name] &= req.specifier
        have = wheels.get(name)
        if have is None or wheel_meta(have)[1] not in specs[name]:
            have = find_wheel(name, specs[name])
            if have is None:
                if parent is None:
                    raise WheelError(f"no wheel meets the root requirement {req}")
                conflicts.append((parent[0], parent[1], f"no wheel meets {name}{specs[name]}"))
                continue
            wheels[name] = have
            seen = {s for s in seen if s[0] != name}  # a new version: walk its requirements again
        _, version, reqs = wheel_meta(have)
        edges.append((who, str(req), f"wheel {version}"))
        for extra in [""] + sorted(req.extras):
            if (name, extra) in seen:
                continue
            seen.add((name, extra))
            queue += [((name, version, extra), r, extra) for r in reqs
                      if (r.marker is None or "extra" not in str(r.marker)) == (extra == "")]
    # drop what versions replaced later in the walk asked for
    live = {"<root>"} | {f"{n} {wheel_meta(w)[1]}" for n, w in wheels.items()}
    edges = [e for e in edges if e[0].split("[")[0] in live]
    there = {n: [f"{spec} (from {who})" for spec, who in v if who.split("[")[0] in live]
             for n, v in check_there.items()}
    return {"wheels": wheels, "edges": edges, "conflicts": conflicts,
            "check_there": {n: v for n, v in there.items() if v}}


def _who(parent: tuple | None) -> str:
    if parent is None:
        return "<root>"
    name, version, extra = parent
    return f"{name} {version}" + (f"[{extra}]" if extra else "")


def resolve_closure(root: Requirement, machine: dict, find_wheel, max_backtracks: int = 40) -> dict:
    """walk() again after each conflict with the blamed parent's version excluded (a one-step
    backtrack: enough for vLLM's tree, where a newest release needs more than a pin allows)."""
    excluded: dict[str, SpecifierSet] = defaultdict(SpecifierSet)
    for _ in range(max_backtracks):
        result = walk(root, machine, find_wheel, excluded)
        if not result["conflicts"]:
            result["excluded"] = {n: str(s) for n, s in excluded.items()}
            return result
        name, version, why = result["conflicts"][0]
        print(f"  conflict: {why} (from {name} {version}); trying {name} != {version}", flush=True)
        excluded[name] &= SpecifierSet(f"!={version}")
    raise WheelError(f"no consistent set after {max_backtracks} backtracks: {result['conflicts'][:3]}")


def local_finder(directory: Path):
    """find_wheel over the wheels in `directory` (newest version meeting the specifier)."""
    cache: dict[Path, tuple] = {}

    def find(name: str, spec: SpecifierSet) -> Path | None:
        ok = []
        for w in directory.glob("*.whl"):
            if w not in cache:
                cache[w] = wheel_meta(w)[:2]
            if cache[w][0] == name and spec.contains(cache[w][1], prereleases=True):
                ok.append((cache[w][1], w))
        return max(ok)[1] if ok else None
    return find


def downloading_finder(directory: Path):
    """find_wheel that reuses a wheel in `directory` or downloads one (pip download --no-deps)."""
    local = local_finder(directory)

    def find(name: str, spec: SpecifierSet) -> Path | None:
        if (have := local(name, spec)) is not None:
            return have
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PIP_PLATFORM, "-d", str(directory),
               f"{name}{spec}"]
        print("  " + " ".join(cmd[2:4] + cmd[-1:]), flush=True)
        if subprocess.run(cmd).returncode != 0:
            return None
        return local(name, spec)
    return find


def summarize(result: dict) -> dict:
    wheels = {n: {"file": p.name, "version": str(wheel_meta(p)[1]), "bytes": p.stat().st_size}
              for n, p in sorted(result["wheels"].items())}
    return {"root": ROOT, "wheels": wheels, "total_bytes": sum(w["bytes"] for w in wheels.values()),
            "excluded": result["excluded"], "edges": result["edges"], "check_there": result["check_there"],
            "kept_from_machine": KEEP_MACHINE}


def resolve(directory: Path) -> dict:
    """Download the closure's wheels into `directory`, delete any other wheel there, write plan.json."""
    directory.mkdir(parents=True, exist_ok=True)
    result = resolve_closure(Requirement(ROOT), machine_packages(), downloading_finder(directory))
    plan = summarize(result)
    keep = {w["file"] for w in plan["wheels"].values()}
    for w in directory.glob("*.whl"):
        if w.name not in keep:
            print(f"  removing {w.name} (not in the closure)")
            w.unlink()
    (directory / PLAN).write_text(json.dumps(plan, indent=1) + "\n")
    return plan


def check(directory: Path) -> list[str]:
    """Problems with the plan in `directory`, recomputed from its wheels' metadata (no network)."""
    if not (directory / PLAN).is_file():
        raise WheelError(f"{directory / PLAN} not found: run `resolve --dir {directory}` first")
    plan = json.loads((directory / PLAN).read_text())
    problems = []
    names = defaultdict(list)
    for w in directory.glob("*.whl"):
        names[wheel_meta(w)[0]].append(w.name)
    problems += [f"two versions of {n}: {', '.join(v)} (keep one)" for n, v in names.items() if len(v) > 1]
    excluded = {n: SpecifierSet(s) for n, s in plan["excluded"].items()}
    again = walk(Requirement(plan["root"]), machine_packages(), local_finder(directory), excluded)
    problems += [f"conflict: {why} (from {n} {v})" for n, v, why in again["conflicts"]]
    staged, needed = set(plan["wheels"]), set(again["wheels"])
    problems += [f"{n}: reached by the requirements but not in {PLAN}" for n in sorted(needed - staged)]
    problems += [f"{n}: in {PLAN} but no requirement reaches it" for n in sorted(staged - needed)]
    for n, w in plan["wheels"].items():
        path = directory / w["file"]
        if not path.is_file():
            problems.append(f"{w['file']} missing from {directory}")
        elif not installable(path):
            problems.append(f"{w['file']}: no tag the machine's CPython 3.12 / manylinux x86-64 installs")
        elif n in again["wheels"] and again["wheels"][n] != path:
            problems.append(f"{n}: plan has {w['file']}, the walk picks {again['wheels'][n].name}")
    return problems


def install(directory: Path, target: Path) -> list[str]:
    """On the GPU machine: pip-install the plan's wheels into `target`, then check every edge of
    the plan against what is importable with `target` ahead of sys.path (the first distribution
    of a name on that path wins, as an import would). Returns the problems."""
    import importlib.metadata as md
    plan = json.loads((directory / PLAN).read_text())
    files = [directory / w["file"] for w in plan["wheels"].values()]
    # benchmarks/gpu/stage/vllm.sh --skip leaves wheels out of the tar: said here, not an error
    problems = [f"{f.name}: left out when staging [left out]" for f in files if not f.is_file()]
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--no-cache-dir", "--upgrade", "--target", str(target), *[str(f) for f in files if f.is_file()]]
    if subprocess.run(cmd).returncode != 0:
        return problems + ["pip install failed (its output is above)"]
    found: dict[str, str] = {}
    for dist in md.distributions(path=[str(target), *sys.path]):
        found.setdefault(canonicalize_name(dist.metadata["Name"] or ""), dist.version)
    for parent, req_s, _ in plan["edges"]:
        req = Requirement(req_s)
        version = found.get(canonicalize_name(req.name))
        if version is None:
            problems.append(f"{req_s} (from {parent}): not installed")
            continue
        if req.specifier and not req.specifier.contains(version, prereleases=True):
            why = KEEP_MACHINE.get(canonicalize_name(req.name))
            problems.append(f"{req_s} (from {parent}): found {version}" + (f" [kept: {why}]" if why else ""))
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("cmd", choices=["resolve", "check", "install"])
    p.add_argument("--dir", type=Path, default=Path(".whl/vllm"), help="the wheels and plan.json")
    p.add_argument("--target", type=Path, default=Path("/tmp/site"), help="install: pip's --target")
    args = p.parse_args(argv)
    try:
        if args.cmd == "resolve":
            plan = resolve(args.dir)
            for n, w in plan["wheels"].items():
                print(f"{w['bytes'] / 2**20:8.1f} MiB  {w['file']}")
            print(f"{len(plan['wheels'])} wheels, {plan['total_bytes'] / 2**20:.1f} MiB; "
                  f"versions ruled out by conflicts: {plan['excluded'] or 'none'}")
            return 0
        problems = check(args.dir) if args.cmd == "check" else install(args.dir, args.target)
    except WheelError as e:
        print(f"vllm_wheels: error: {e}", file=sys.stderr)
        return 2
    if args.cmd == "check":
        plan = json.loads((args.dir / PLAN).read_text())
        print(f"{len(plan['wheels'])} wheels, {plan['total_bytes'] / 2**20:.1f} MiB; "
              f"{len(plan['check_there'])} machine packages whose versions are checked there: "
              + ", ".join(f"{n} {'; '.join(s)}" for n, s in sorted(plan["check_there"].items())))
    for line in problems:
        print(f"PROBLEM {line}")
    print(f"{args.cmd}: {len(problems)} problem(s)")
    strict = [x for x in problems if "[kept:" not in x and "[left out]" not in x]
    return 1 if strict else 0


if __name__ == "__main__":
    sys.exit(main())
