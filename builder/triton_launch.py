"""Run the Triton Inference Server that the `nvidia-pytriton` wheel bundles, on an exported repo.

A Triton container needs none of this (``tritonserver --model-repository REPO``). Without one,
``pip install --no-deps nvidia-pytriton==0.7.0`` brings ``tritonserver`` 2.51 and its Python
backend, which run on CPU once three things are arranged (what pytriton itself does):

- the backend folder gets the ``triton_python_backend_stub`` built for this Python version;
- ``LD_LIBRARY_PATH`` holds the wheel's bundled libraries and, first, the libpython of this
  interpreter (else the stub links the system's libpython of the same minor version, which may
  be older than this interpreter's stdlib: ``undefined symbol: _PyModule_Add`` from ``_ssl``);
- ``PATH`` starts with this interpreter's folder, so the stub's embedded Python takes this
  environment's site-packages (where infhip, torch and numpy are).

The stub deserializes string tensors with numpy; with numpy 2.4.6 in the environment a string
input crashed it (``unpack_from requires a buffer of at least ...``), with numpy 1.26.4 it works:
`numpy_ok` says whether this environment qualifies.

    >>> from infhip.builder.triton_launch import server_command     # doctest: +SKIP
    >>> argv, env = server_command("triton_repo", "/tmp/triton_backends", http_port=8000)
    >>> subprocess.Popen(argv, env=env)
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path


class TritonNotFound(RuntimeError):
    """nvidia-pytriton (the bundled tritonserver) is not installed here."""


def pytriton_dist() -> Path:
    """The ``tritonserver`` folder inside the installed pytriton package."""
    spec = importlib.util.find_spec("pytriton")  # not imported: only its files are needed
    if spec is None or not spec.submodule_search_locations:
        raise TritonNotFound("nvidia-pytriton is not installed; pip install --no-deps nvidia-pytriton==0.7.0 "
                             "(or use a Triton Inference Server container)")
    dist = Path(spec.submodule_search_locations[0]) / "tritonserver"
    if not (dist / "bin" / "tritonserver").is_file():
        raise TritonNotFound(f"{dist} has no bin/tritonserver; reinstall nvidia-pytriton")
    return dist


def numpy_ok() -> bool:
    """Whether this environment's numpy lets the stub read string tensors (numpy < 2)."""
    import numpy
    return int(numpy.__version__.split(".")[0]) < 2


def prepare_backends(backend_dir: str | os.PathLike) -> Path:
    """Fill backend_dir/python with the Python backend and the stub for this Python version."""
    dist = pytriton_dist()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = dist / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise TritonNotFound(f"nvidia-pytriton has no Python-backend stub for Python {version} ({stub})")
    python = Path(backend_dir) / "python"
    python.mkdir(parents=True, exist_ok=True)
    for f in (dist / "backends" / "python").iterdir():
        if f.is_file():
            shutil.copy2(f, python / f.name)
    shutil.copy2(stub, python / stub.name)
    return Path(backend_dir)


def server_command(repo_dir: str | os.PathLike, backend_dir: str | os.PathLike, http_port: int = 8000,
                   grpc_port: int = 8001, metrics_port: int = 8002) -> tuple[list[str], dict[str, str]]:
    """(argv, env) that run the bundled tritonserver over repo_dir, backends prepared in backend_dir."""
    dist = pytriton_dist()
    backends = prepare_backends(backend_dir)
    libs = [dist.parent.parent / "nvidia_pytriton.libs"]
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        libs.insert(0, Path(sysconfig.get_config_var("LIBDIR")))
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join([str(p) for p in libs] + [env.get("LD_LIBRARY_PATH", "")]).rstrip(os.pathsep)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    argv = [str(dist / "bin" / "tritonserver"), "--model-repository", str(Path(repo_dir).resolve()),
            "--backend-directory", str(backends.resolve()), "--http-port", str(http_port),
            "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port), "--exit-timeout-secs", "5"]
    return argv, env


def stop_server(proc: subprocess.Popen, grace_s: float = 30) -> None:
    """Terminate a tritonserver started from server_command, killing it if it outlives grace_s."""
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
