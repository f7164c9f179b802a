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


def test_step_plan_length_bucket_is_the_plan_rule():
    """The step plan's decode length bucket (computed per step without leaving the plan, so an eager
    step does not call runtime/cuda_graphs.py) is plugins/plan_rules.len_bucket's, capped below the
    block-table width, and the split bound falls back to that width."""
    from infhip.plugins.plan_rules import DECODE_LEN_BUCKETS, len_bucket
    from infhip.runtime.step_plan import StepPlan

    def plan(ctx_lens, num_decodes, backends=None):
        return StepPlan(input_ids=[], positions=[], cu=[], ctx_lens=ctx_lens, logits_rows=[], slots={}, tables={},
                        num_decodes=num_decodes, backends=backends or {})

    for table in (300, 512, 513, 4096, 10_000):
        for n in (1, 299, 511, 512, 513, 2047, 2048, 2049, 8192, 8193, 9999):
            rule = len_bucket(n)
            want = rule if rule is not None and rule < table else None
            p = plan([7, n, 3], num_decodes=3)
            assert p.len_bucket(table) == want, (table, n)
            assert p.decode_len_bound(table) == (want or table)
    assert plan([5], 0).len_bucket(4096) is None  # no decode row
    assert plan([5], 1, backends={"infinitehip": object()}).len_bucket(4096) is None  # a backend's rows
    assert DECODE_LEN_BUCKETS[0] == 512  # (the cases above straddle each bucket)
