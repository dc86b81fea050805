"""Runtime directories left by a killed `serve` are removed by the next one, and nothing else is."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from common.runtime_dir import OWNER_FILE, create_runtime_dir, remove_stale_runtime_dirs


def _dir_of_exited_process(parent: Path) -> Path:
    """A runtime directory created by a process that has since exited (as after kill -9 of serve)."""
    code = f"from common.runtime_dir import create_runtime_dir; print(create_runtime_dir({str(parent)!r}))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return Path(out.stdout.strip())


def test_new_dir_is_private_and_names_its_owner(tmp_path: Path) -> None:
    path = Path(create_runtime_dir(str(tmp_path)))
    assert path.name.startswith("pagedserve-")
    assert path.stat().st_mode & 0o777 == 0o700
    assert (path / OWNER_FILE).read_text().strip() == str(os.getpid())


def test_dir_of_a_dead_serve_is_removed(tmp_path: Path) -> None:
    stale = _dir_of_exited_process(tmp_path)
    (stale / "scheduler").write_text("")  # a socket file left behind
    assert remove_stale_runtime_dirs(str(tmp_path)) == [str(stale)]
    assert not stale.exists()


def test_live_foreign_and_unrelated_dirs_are_kept(tmp_path: Path) -> None:
    live = Path(create_runtime_dir(str(tmp_path)))  # this process is its owner, and alive
    no_owner = tmp_path / "pagedserve-manual"  # e.g. --runtime-dir or another program's
    no_owner.mkdir()
    garbage = tmp_path / "pagedserve-garbage"
    garbage.mkdir()
    (garbage / OWNER_FILE).write_text("not a pid")
    init = tmp_path / "pagedserve-init"
    init.mkdir()
    (init / OWNER_FILE).write_text("1\n")  # pid 1 is alive (and not ours)
    other_prefix = tmp_path / "other-dir"
    other_prefix.mkdir()
    (other_prefix / OWNER_FILE).write_text("999999999\n")
    stale = _dir_of_exited_process(tmp_path)

    assert remove_stale_runtime_dirs(str(tmp_path)) == [str(stale)]
    for kept in (live, no_owner, garbage, init, other_prefix):
        assert kept.exists(), kept
