"""Runs `python -m MODULE ARGV` entry points as forked children of one process that imported torch
and infhip once (~3 s of CPU each entry point would otherwise pay: most of a tiny run's cost), for
tests/test_gpu_suites_on_cpu.py. Each child starts from the same clean parent (nothing one entry
point changes reaches the next) and runs the module as `python -m` would (runpy, "__main__").

Protocol, one JSON object a line: stdin {"module" (or "path": a script), "argv", "env", "cwd", "log"}
-> stdout {"rc", "cpu_s"};
the child's stdout and stderr go to the file "log". The plugins pick the interpreter or their torch
references at import (TRITON_INTERPRET), so this parent runs with TRITON_INTERPRET=0 only; an entry
point that needs the interpreter runs in a plain subprocess instead.

    python -m tests._fork_runner        # from the repository root
"""

from __future__ import annotations

import json
import os
import resource
import runpy
import sys
import traceback


def _child(req: dict) -> None:
    fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    sys.argv = [req.get("path") or req["module"], *req["argv"]]
    code = 0
    try:
        if req.get("path"):  # a suite's inline `python3 - ARGS <<'EOF'`, written to a file
            runpy.run_path(req["path"], run_name="__main__")
        else:
            runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001  (whatever it is, the log says it and the status shows it)
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "0", "run with TRITON_INTERPRET=0 (see the docstring)"
    import torch  # noqa: F401  (the imports every child shares)
    import infhip.builder.build  # noqa: F401
    from infhip import LLM  # noqa: F401

    for line in sys.stdin:
        req = json.loads(line)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        pid = os.fork()
        if pid == 0:
            _child(req)
        _, status = os.waitpid(pid, 0)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status), "cpu_s": round(cpu, 2)}), flush=True)


if __name__ == "__main__":
    main()
