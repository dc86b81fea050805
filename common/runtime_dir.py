"""The private directory `pagedserve serve` keeps its internal sockets in.

A serve that is killed with SIGKILL cannot remove its directory (its
components die with it, by PDEATHSIG, but nothing runs its cleanup), so each
directory records its owner's pid and the next `serve` of the same user
removes those whose owner is gone.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger("pagedserve.serve")

PREFIX = "pagedserve-"
OWNER_FILE = "serve.pid"


def create_runtime_dir(parent: str | None = None) -> str:
    """A new private directory (mode 0700) that names this process as its owner."""
    path = tempfile.mkdtemp(prefix=PREFIX, dir=parent)
    Path(path, OWNER_FILE).write_text(f"{os.getpid()}\n")
    return path


def remove_stale_runtime_dirs(parent: str | None = None) -> list[str]:
    """Remove this user's runtime directories whose serve process no longer exists.

    Only directories with our prefix, owned by this user and holding an owner
    file with a dead pid are touched: a directory without one may be another
    program's, and a live pid (even one reused by an unrelated process) keeps
    its directory, which at worst leaves a leftover rather than breaking a server.
    """
    removed = []
    for entry in Path(parent or tempfile.gettempdir()).glob(f"{PREFIX}*"):
        try:
            if not entry.is_dir() or entry.is_symlink() or entry.stat().st_uid != os.getuid():
                continue
            owner = int((entry / OWNER_FILE).read_text().strip())
        except (OSError, ValueError):
            continue
        if owner <= 0 or _process_exists(owner):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(str(entry))
    if removed:
        logger.info("removed %d runtime director%s left by killed servers: %s",
                    len(removed), "y" if len(removed) == 1 else "ies", ", ".join(removed))
    return removed


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    return True
