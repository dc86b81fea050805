"""Lay out a Hugging Face Hub cache as huggingface_hub writes one, without the Hub.

`HF_HOME/hub/models--ORG--NAME/` holds `blobs/<digest>` (the file contents),
`snapshots/<commit>/<path>` (relative symlinks to those blobs) and `refs/<branch or
tag>` (the commit it points at). With HF_HUB_OFFLINE=1 huggingface_hub resolves a
model from exactly this, so the tests exercise the real lookup, offline.
"""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path


def repo_cache_dir(hf_home: Path, repo_id: str) -> Path:
    return hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))


def _blob(blobs: Path, source: Path) -> str:
    digest = hashlib.sha256()
    with open(source, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    name = digest.hexdigest()
    target = blobs / name
    if not target.exists():
        try:
            os.link(source, target)  # the same file system: no copy of a large weight file
        except OSError:
            shutil.copyfile(source, target)
    return name


def add_hub_snapshot(hf_home: Path, repo_id: str, files: dict[str, Path], *, refs: tuple[str, ...] = ("main",),
                     commit: str | None = None) -> str:
    """Put `files` (path in the repository -> local file) into the cache as commit `commit`
    (by default a digest of repo and contents) of `repo_id`, each of `refs` pointing at
    it. Returns the commit hash."""
    repo = repo_cache_dir(hf_home, repo_id)
    blobs = repo / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    names = {path: _blob(blobs, Path(source)) for path, source in sorted(files.items())}
    commit = commit or hashlib.sha1(repr((repo_id, sorted(names.items()))).encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    for path, blob in names.items():
        link = snapshot / path
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            link.symlink_to(os.path.relpath(blobs / blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)  # huggingface_hub writes the hash, no newline
    return commit


def add_hub_model_dir(hf_home: Path, repo_id: str, directory: Path, **options) -> str:
    """Every file of model directory `directory` as a snapshot of `repo_id` (see add_hub_snapshot)."""
    return add_hub_snapshot(hf_home, repo_id, {p.name: p for p in sorted(directory.iterdir()) if p.is_file()},
                            **options)
