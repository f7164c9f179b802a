"""The request path stays as short as docs/design/request_path.md says: the trace
(tests/request_path_trace.py, in a fresh interpreter) of a dense streaming chat request runs no
more files than the page's count, and none that its table does not list. A file that joins the
path (a feature that is off but still called per step, a new module on the step) fails here until
the page says why it belongs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "design" / "request_path.md"


def documented() -> tuple[int, set[str]]:
    """(the count of the page's "## The files (N)" heading, the paths its table lists)."""
    text = DOC.read_text()
    count = int(re.search(r"^## The files \((\d+)\)$", text, re.M).group(1))
    table = text.split("## The files", 1)[1].split("\n## ", 1)[0]
    return count, set(re.findall(r"`((?:runtime|plugins|infhip|builder)/[\w/]+\.py)`", table))


def test_dense_chat_request_path_is_the_documented_one():
    count, listed = documented()
    assert len(listed) == count, f"{DOC.name}: the table lists {len(listed)} files, the heading says {count}"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # as the page measures it
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "request_path_trace.py")], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.split()
    found = set(lines[1:])
    assert int(lines[0]) == len(found) > 10, run.stdout
    new = sorted(found - listed)
    assert not new and len(found) <= count, (
        f"a dense streaming chat request now runs {len(found)} files (docs/design/request_path.md: {count}); "
        f"not on the page: {new}. Keep features that are off out of the step path, or document the file "
        "and the count there")
