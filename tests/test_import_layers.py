"""The layers of pyproject.toml's import-linter contracts hold, and breaking one fails the check."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pagedserve", "common", "scheduler", "worker", "frontend", "tokenizer_pool")


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """Run import-linter on the packages under `root` (they shadow the installed ones)."""
    script = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run([sys.executable, "-c", script, "--config", str(root / "pyproject.toml"), "--no-cache"],
                          cwd=root, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=300)


def test_the_layer_contracts_hold():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout and "BROKEN" not in result.stdout


@pytest.fixture()
def tree_copy(tmp_path: Path) -> Path:
    """The packages' Python sources and pyproject.toml, copied."""
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


@pytest.mark.parametrize("module, line, contract", [
    ("scheduler/block_pool.py", "import frontend", "The scheduler imports only common, and no torch"),
    ("scheduler/block_pool.py", "import torch", "The scheduler imports only common, and no torch"),
    ("common/config.py", "import worker", "common imports no component"),
    ("worker/__init__.py", "import frontend", "The worker and the frontend never import each other"),
    ("tokenizer_pool/__init__.py", "import scheduler", "The tokenizer pool imports only common"),
    ("frontend/__init__.py", "import pagedserve", "No component imports the pagedserve package on top"),
])
def test_an_import_against_the_layers_fails_the_check(tree_copy: Path, module: str, line: str, contract: str):
    path = tree_copy / module
    path.write_text(path.read_text() + f"\n{line}  # the violation under test\n")
    result = lint_imports(tree_copy)
    assert result.returncode != 0
    assert f"{contract} BROKEN" in result.stdout, result.stdout


def test_an_import_cycle_fails_the_check(tree_copy: Path):
    # common.errors is imported by common.config; importing back closes a cycle inside common.
    path = tree_copy / "common" / "errors.py"
    path.write_text(path.read_text() + "\nimport common.config  # the cycle under test\n")
    result = lint_imports(tree_copy)
    assert result.returncode != 0
    assert "No import cycles inside any package BROKEN" in result.stdout, result.stdout


@pytest.mark.parametrize("command", ["frontend", "scheduler", "tokenizer", "serve"])
def test_components_started_through_the_cli_do_not_import_torch(command):
    """Every component process starts as `python -m pagedserve.cli COMMAND`: the package and
    the frontend, scheduler and tokenizer pool modules load without torch (seconds and hundreds
    of MB a process), while `from pagedserve import LLM` still works."""
    from pagedserve.cli import COMMANDS

    script = (f"import importlib, sys, pagedserve, pagedserve.cli; importlib.import_module({COMMANDS[command][0]!r}); "
              "print('torch' in sys.modules); from pagedserve import LLM, RequestOutput; print(LLM.__name__)")
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "LLM"]
