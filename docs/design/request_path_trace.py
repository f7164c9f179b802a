"""Which infhip source files run for one dense streaming chat request (after load and a first
request): a trace function on every thread records each Python call's file under the repository
while one request is served by infhip-serve over the tiny Llama engine (float32, CPU)."""
import http.client, json, sys, threading, tempfile
from pathlib import Path

ROOT = Path(sys.argv[1]).resolve()
sys.path.insert(0, str(ROOT))
files, recording = set(), [False]

def tracer(frame, event, arg):
    if recording[0] and event == "call":
        f = frame.f_code.co_filename
        if f.startswith(str(ROOT)) and "/.venv/" not in f and "/tests/" not in f:
            files.add(str(Path(f).relative_to(ROOT)))
    return None

threading.settrace(tracer); sys.settrace(tracer)
from tests._tiny import build_tiny_api_engine
from infhip import LLM
from infhip.runtime.server import make_server

engine = build_tiny_api_engine(Path(tempfile.mkdtemp()))
llm = LLM(engine)
server = make_server(llm, port=0)
server.start()
body = {"model": "infhip", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8, "stream": True}

def request():
    conn = http.client.HTTPConnection(*server.server_address, timeout=60)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse(); data = resp.read(); conn.close()
    assert resp.status == 200 and data.rstrip().endswith(b"[DONE]"), data[-200:]

request()  # warm: lazy imports, first-step paths
recording[0] = True
request()
recording[0] = False
server.shutdown()
for f in sorted(files):
    print(f)
print(len(files), file=sys.stderr)
