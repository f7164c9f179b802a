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

tritonserver listens on all interfaces unless told otherwise; `server_command` binds HTTP,
gRPC and metrics to ``host`` (loopback by default). `running_server` owns one server: the
backend folder is a temporary one removed at the end (also on error), tritonserver runs in a
process group of its own, and stopping it (`stop_server`) waits for it to unload the model,
then kills whatever is left of that group, so no Python-backend stub outlives it.

Stopping is a drain: SIGTERM makes tritonserver refuse new requests (UNAVAILABLE) and wait for
the running ones; after `drain_timeout_s` (or at once when `end_now` is set: a second signal)
the launcher writes the model's END_MARKER (runtime/serving/triton/model.py), which ends every running
request with a last "abort" response, so Triton unloads the model in order instead of giving
up on it at its --exit-timeout-secs.

    >>> from infhip.runtime.serving.triton.launch import running_server     # doctest: +SKIP
    >>> with running_server("triton_repo", http_port=8000) as server:
    ...     print(server.url)                                     # http://127.0.0.1:8000
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import threading
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


class TritonNotFound(RuntimeError):
    """nvidia-pytriton (the bundled tritonserver) is not installed here."""


def pytriton_dist() -> Path:
    """The ``tritonserver`` folder inside the installed pytriton package."""
    spec = importlib.util.find_spec("pytriton")  # not imported: only its files are needed
    if spec is None or not spec.submodule_search_locations:
        raise TritonNotFound("nvidia-pytriton is not installed; pip install -e \".[triton-server]\" "
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


DRAIN_TIMEOUT_S = 30.0  # how long running requests may go on once the server is asked to stop
END_GRACE_S = 5  # after the END_MARKER: for the ended requests' last responses to go out
UNLOAD_S = 30  # after the drain: for the model's unload (the stub's interpreter teardown is 3-5 s) and exit


def server_command(repo_dir: str | os.PathLike, backend_dir: str | os.PathLike, http_port: int = 8000,
                   grpc_port: int = 8001, metrics_port: int = 8002, host: str = "127.0.0.1",
                   drain_timeout_s: float = DRAIN_TIMEOUT_S) -> tuple[list[str], dict[str, str]]:
    """(argv, env) that run the bundled tritonserver over repo_dir, backends prepared in
    backend_dir, its HTTP, gRPC and metrics endpoints bound to host. Its own exit timeout
    outlasts the launcher's drain, so it is the launcher that ends what still runs."""
    dist = pytriton_dist()
    backends = prepare_backends(backend_dir)
    libs = [dist.parent.parent / "nvidia_pytriton.libs"]
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        libs.insert(0, Path(sysconfig.get_config_var("LIBDIR")))
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join([str(p) for p in libs] + [env.get("LD_LIBRARY_PATH", "")]).rstrip(os.pathsep)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    argv = [str(dist / "bin" / "tritonserver"), "--model-repository", str(Path(repo_dir).resolve()),
            "--backend-directory", str(backends.resolve()),
            "--http-address", host, "--http-port", str(http_port),
            "--grpc-address", host, "--grpc-port", str(grpc_port),
            "--metrics-address", host, "--metrics-port", str(metrics_port),
            "--exit-timeout-secs", str(math.ceil(drain_timeout_s) + END_GRACE_S)]
    return argv, env


@dataclass
class TritonServer:
    """A tritonserver started by `running_server`, and where it listens."""

    proc: subprocess.Popen
    host: str
    http_port: int
    grpc_port: int
    metrics_port: int

    @property
    def url(self) -> str:
        """Base URL of the HTTP endpoint (``/v2/...``)."""
        return f"http://{_url_host(self.host)}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        """host:port of the gRPC endpoint (what tritonclient.grpc takes)."""
        return f"{_url_host(self.host)}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{_url_host(self.host)}:{self.metrics_port}/metrics"


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host  # an IPv6 address


@contextlib.contextmanager
def running_server(repo_dir: str | os.PathLike, host: str = "127.0.0.1", http_port: int = 8000,
                   grpc_port: int = 8001, metrics_port: int = 8002, log=None,
                   ready_timeout_s: float = 300, drain_timeout_s: float = DRAIN_TIMEOUT_S,
                   end_now: threading.Event | None = None) -> Iterator[TritonServer]:
    """Start the bundled tritonserver over repo_dir and yield it once its models are ready; on
    leaving, stop it (`stop_server`: a drain of drain_timeout_s, cut short by end_now) and
    remove its temporary backend folder.

    log: a file for the server's output (default: this process's stdout and stderr).
    Raises RuntimeError if it exits or is not ready within ready_timeout_s.
    """
    backend_dir = tempfile.mkdtemp(prefix="infhip-triton-backends-")
    try:
        argv, env = server_command(repo_dir, backend_dir, http_port, grpc_port, metrics_port, host, drain_timeout_s)
        # A session of its own: a terminal's Ctrl-C reaches only the launcher, which stops the
        # server in order; and its process group holds the stub, for the sweep after it exits.
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT if log is not None else None,
                                start_new_session=True)
        try:
            server = TritonServer(proc, host, http_port, grpc_port, metrics_port)
            _wait_ready(server, ready_timeout_s)
            yield server
        finally:
            stop_server(proc, drain_timeout_s, repo_dir, end_now)
    finally:
        shutil.rmtree(backend_dir, ignore_errors=True)


def end_requests(repo_dir: str | os.PathLike) -> None:
    """Write END_MARKER into every model folder of repo_dir: the infhip models there end their
    running requests ("abort") within 0.1 s."""
    from infhip.runtime.serving.triton.model import END_MARKER
    for config in Path(repo_dir).glob("*/config.pbtxt"):
        (config.parent / END_MARKER).touch()


def _wait_ready(server: TritonServer, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"tritonserver exited with status {server.proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{server.url}/v2/health/ready", timeout=2):
                return
        except OSError:  # not listening yet, or 400 while the model loads
            time.sleep(0.25)
    raise RuntimeError(f"tritonserver was not ready after {timeout_s:.0f} s")


def stop_server(proc: subprocess.Popen, drain_timeout_s: float = DRAIN_TIMEOUT_S,
                repo_dir: str | os.PathLike | None = None, end_now: threading.Event | None = None) -> None:
    """Stop a tritonserver started by `running_server`: SIGTERM (Triton refuses new requests
    and waits for the running ones); once drain_timeout_s has passed or end_now is set, the END
    marker in every model of repo_dir ends what still runs; the models unload and their stubs
    end; UNLOAD_S after that, SIGKILL. Then kill whatever is left in its process group (a stub
    whose server died first), so nothing outlives it."""
    if proc.poll() is None:
        proc.terminate()
        deadline = time.monotonic() + drain_timeout_s
        while proc.poll() is None and time.monotonic() < deadline and not (end_now and end_now.is_set()):
            time.sleep(0.05)
        if proc.poll() is None and repo_dir is not None:
            end_requests(repo_dir)
        try:
            proc.wait(END_GRACE_S + UNLOAD_S)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # its own group (start_new_session): the server and its stubs
    except ProcessLookupError:
        pass  # the group is empty: all of it exited
    proc.wait()
