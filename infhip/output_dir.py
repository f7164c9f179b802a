"""The output folder of a build or an export, written atomically: a temporary sibling
``.<name>.tmp-XXXX`` that a running build locks (so it is never taken for a killed build's
leftover), checks that an existing output may be replaced, and `install_dir`, the rename into
place (builder/build.py, runtime/serving/triton/export.py)."""

from __future__ import annotations

import fcntl
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from infhip.errors import BuildError
from infhip.config import is_engine_dir

# A running build holds an exclusive flock on this file in its temporary folder; the kernel drops
# the lock when the process dies, however it dies.
TMP_LOCK = ".infhip-build.lock"
# A temporary folder without the lock file is a leftover once this old: one written before the
# lock existed (a build holds its lock from right after mkdtemp until right before the rename).
_UNLOCKED_GRACE_S = 60.0


def umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def check_output(out: Path, force: bool) -> None:
    if not out.exists():
        return
    if not force:
        raise BuildError(f"{out} already exists; pass --force to replace it")
    if not out.is_dir():
        raise BuildError(f"{out} exists and is not a directory; remove it or choose another --output")
    # --force replaces engines, never arbitrary folders (think --output ~ --force) or checkpoints.
    if any(out.iterdir()) and not is_engine_dir(out):
        raise BuildError(f"refusing to replace {out}: it is not an infhip engine directory (no engine "
                         "config.json); choose another --output, or remove it yourself")


def check_apart(out: Path, source: Path) -> None:
    """The output (replaced as a whole) must not be the checkpoint, hold it, or lie inside it."""
    o, s = out.resolve(), source.resolve()
    if o == s or s.is_relative_to(o):
        where = "is" if o == s else "contains"
        raise BuildError(f"--output {out} {where} the checkpoint {source}: writing the engine there would "
                         "replace the checkpoint; choose an --output outside it")
    if o.is_relative_to(s):
        raise BuildError(f"--output {out} lies inside the checkpoint {source}; choose an --output outside it")


def lock_tmp(tmp: Path) -> int:
    """Mark tmp as a running build's (see TMP_LOCK); returns the fd that holds the lock."""
    fd = os.open(tmp / TMP_LOCK, os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # a filesystem without locks: the build goes on; its leftovers then stay
        pass
    return fd


def _is_leftover(tmp: Path) -> bool:
    """Is tmp a temporary folder whose build is gone (its lock free, or no lock and old)?"""
    try:
        fd = os.open(tmp / TMP_LOCK, os.O_RDONLY)
    except FileNotFoundError:
        return time.time() - tmp.stat().st_mtime > _UNLOCKED_GRACE_S
    except OSError:  # not ours to open (another user's build): leave it
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:  # a build is writing it (or no locks here, so nobody can tell): leave it
        return False
    finally:
        os.close(fd)


def remove_leftovers(out: Path) -> None:
    """Remove the temporary folders of killed builds of out (siblings .<name>.tmp-*), saying so."""
    prefix = f".{out.name}.tmp-"
    found = [p for p in out.parent.iterdir()
             if p.name.startswith(prefix) and p.is_dir() and not p.is_symlink() and _is_leftover(p)]
    if not found:
        return
    size = sum(dir_size(p) for p in found)
    for p in found:
        shutil.rmtree(p, ignore_errors=True)
    print(f"infhip-build: removed {len(found)} unfinished folder(s) left by killed builds of {out} "
          f"({size / 2**20:.1f} MiB): {', '.join(p.name for p in found)}", file=sys.stderr)


def install_dir(tmp: Path, out: Path, check_existing: Callable[[Path], None]) -> None:
    """Rename the finished folder tmp to out; an existing out is first re-checked with
    check_existing (it may have appeared while tmp was written), moved aside, and deleted only
    after the rename succeeded (restored if it failed). Used by the builder and the exporters."""
    old = None
    if out.exists():
        check_existing(out)
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.rename(out, old / out.name)
    try:
        os.rename(tmp, out)
    except OSError:
        if old is not None:
            os.rename(old / out.name, out)
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
