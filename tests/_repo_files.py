"""The repository's own files (what git tracks, and new files it does not ignore), for the checks
that read every source or doc file: tests/test_doc_paths.py, tests/test_source_grammar.py.

Without git (an unpacked archive) the tree is walked instead, leaving out what .gitignore names
(environments, caches, built engines)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOT_SOURCES = {".git", ".venv", "__pycache__", ".cache", ".stage", ".whl", ".pytest_cache", "build", "dist"}


def repo_files(suffix: str = "") -> list[str]:
    """Paths relative to the repository root, sorted; only those ending in ``suffix`` if given."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        out = []
        for folder, dirs, files in os.walk(ROOT):  # pruned: never into .venv or .git
            dirs[:] = [d for d in dirs if d not in NOT_SOURCES and not d.endswith(".egg-info")]
            out += [str(rel) for f in files if _source(rel := (Path(folder) / f).relative_to(ROOT))]
    return sorted(p for p in out if p.endswith(suffix) and (ROOT / p).is_file())


def _source(rel: Path) -> bool:
    if NOT_SOURCES & set(rel.parts) or any(part.endswith(".egg-info") for part in rel.parts):
        return False
    return rel.parts[0] != "engines" or rel.name == "README.md"
