"""examples/triton_serve.py in the real Triton Inference Server (nvidia-pytriton's bundled
tritonserver on CPU, a tiny engine): stopped by SIGTERM it drains (a request arriving meanwhile is
refused, a running stream ends with a last "abort" response once the drain timeout passes), exits
0 and leaves no process and no folder behind; a server that cannot start removes its temporary
folder. The server's requests, load and metrics: tests/test_triton_server.py. Skipped as that file."""

from __future__ import annotations

import http.client
import json
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests._triton import LOOPBACK, free_ports, listening, skip_reason

pytestmark = pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason()))

GREEDY = dict(temperature=0.0, ignore_eos=True)
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def engine(tiny_engine):
    return tiny_engine("llama", tokenizer=True, max_seq_len=4096, max_batch_size=16)


# -- the example launcher -----------------------------------------------------------------------
def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:  # fields[1]: the parent's pid
            kids.append(int(stat.parent.name))
    return kids


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _stream_events(port: int, body: dict, events: list, first: threading.Event) -> None:
    """POST generate_stream and append each event's JSON to events (first: set at the first)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v2/models/tiny/generate_stream", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    while line := resp.readline():
        if line.startswith(b"data: "):
            events.append(json.loads(line[len(b"data: "):]))
            first.set()
    conn.close()


def test_example_drains_and_stops_everything_on_sigterm(engine, tmp_path):
    http_port = free_ports(1)[0]
    proc = subprocess.Popen([sys.executable, str(ROOT / "examples" / "triton_serve.py"), "--engine", str(engine),
                             "--repo", str(tmp_path / "repo"), "--port", str(http_port), "--max-tokens", "4",
                             "--keep", "--drain-timeout", "2", "--model-name", "tiny"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines: queue.Queue = queue.Queue()  # its output, then None at its end
    threading.Thread(target=lambda: [*map(lines.put, proc.stdout), lines.put(None)], daemon=True).start()
    output = []
    try:
        while not (output and output[-1].startswith("serving")):
            line = lines.get(timeout=240)
            assert line is not None, f"the example ended (status {proc.wait()}):\n{''.join(output)[-3000:]}"
            output.append(line)
        server_pid = int(re.search(r"tritonserver \(pid (\d+)\)", "".join(output)).group(1))
        assert f"HTTP http://127.0.0.1:{http_port}" in "".join(output)
        assert any('"output_ids"' in line for line in output)  # the demo requests were answered
        for port in (http_port, http_port + 1, http_port + 2):
            assert set(listening(port)) <= LOOPBACK and listening(port)
        stubs = _children(server_pid)
        backends = re.search(r"--backend-directory\x00([^\x00]+)", Path(f"/proc/{server_pid}/cmdline").read_text())
        assert stubs and Path(backends.group(1)).is_dir()

        events, first = [], threading.Event()
        body = {"text_input": "hi", "max_tokens": 3000, "stream": True, **GREEDY}  # seconds of tokens
        streamer = threading.Thread(target=_stream_events, args=(http_port, body, events, first), daemon=True)
        streamer.start()
        assert first.wait(60)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        late = _post_status(f"http://127.0.0.1:{http_port}/v2/models/tiny/generate",
                            {"text_input": "late", "max_tokens": 2})
        ready = _get_status(f"http://127.0.0.1:{http_port}/v2/health/ready")
        streamer.join(60)
        assert proc.wait(timeout=90) == 0
        assert late[0] != 200 and ready != 200, (late, ready)  # Triton refuses while it drains
        assert events[-1]["finish_reason"] == "abort" and all(e["finish_reason"] == "" for e in events[:-1])
        assert 1 < len(events) < 3000
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not _alive(server_pid) and not any(_alive(pid) for pid in stubs)
    assert not Path(backends.group(1)).exists()
    assert listening(http_port) == []


def _post_status(url: str, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:  # refused: the listener is gone
        return -1, repr(e)


def _get_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return -1


def test_failed_start_leaves_nothing(tmp_path, monkeypatch):
    """A server that cannot start (here: a config.pbtxt Triton cannot parse) raises, and its
    temporary backend folder is removed all the same."""
    from infhip.runtime.serving.triton import launch as triton_launch
    made = []
    mkdtemp = triton_launch.tempfile.mkdtemp
    monkeypatch.setattr(triton_launch.tempfile, "mkdtemp", lambda **kw: made.append(mkdtemp(**kw)) or made[-1])
    (tmp_path / "repo" / "broken" / "1").mkdir(parents=True)
    (tmp_path / "repo" / "broken" / "config.pbtxt").write_text("backend: {")
    with open(tmp_path / "server.log", "wb") as log, pytest.raises(RuntimeError, match="exited with status"):
        with triton_launch.running_server(tmp_path / "repo", "127.0.0.1", *free_ports(3), log=log):
            pass
    assert len(made) == 1 and not Path(made[0]).exists()
