"""`make gpu-bundle`: what a fresh GPU machine needs beyond torch, triton and transformers.

That machine has no network, so wheels travel with the working tree (build/gpu-bundle/,
git-ignored, carried to it; the carry limit is 64 MiB in all). Only what the GPU run
imports is bundled: the offline engine's msgspec and pyzmq, and pytest for the CUDA
test subset. The default model's GGUF (94 MiB) does not fit, so its config and
tokenizer files travel and the GPU machine builds random weights from them.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

# Top-level requirements; pip adds their dependencies (pytest's iniconfig, pluggy, ...).
REQUIREMENTS = ("msgspec", "pyzmq", "pytest", "pytest-timeout")
# Installed on the GPU machine already (with their own dependencies: numpy, tokenizers,
# safetensors, huggingface-hub, pyyaml, tqdm, jinja2, packaging, ...).
# pip download judges environment markers by the running Python: pytest's backports for 3.10.
EXTRA_FOR_PYTHON = {"3.10": ("exceptiongroup", "tomli")}
PREINSTALLED = ("torch", "triton", "transformers")
PYTHON_VERSIONS = ("3.10", "3.11", "3.12", "3.13")
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64")
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "chat_template.jinja")
SIZE_LIMIT = 50 * 1024 * 1024
DEFAULT_MODEL = "smollm2-135m-instruct"


def download_wheels(wheel_dir: Path) -> None:
    for version in PYTHON_VERSIONS:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--implementation", "cp",
               "--python-version", version, "--dest", str(wheel_dir)]
        for platform in PLATFORMS:
            cmd += ["--platform", platform]
        subprocess.run(cmd + [*REQUIREMENTS, *EXTRA_FOR_PYTHON.get(version, ())], check=True)


def copy_model_files(model_dir: Path) -> None:
    from common.model_files import resolve_model_dir

    source = Path(resolve_model_dir(DEFAULT_MODEL))
    model_dir.mkdir(parents=True, exist_ok=True)
    for name in MODEL_FILES:
        if (source / name).exists():
            shutil.copy2(source / name, model_dir / name)
    if not (model_dir / "config.json").exists():
        raise SystemExit(f"{source} has no config.json")


def total_size(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default="build/gpu-bundle")
    args = parser.parse_args(argv)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    download_wheels(out / "wheels")
    copy_model_files(out / "model")
    # Markers pick the backports on 3.10 only.
    extras = [f"{name}; python_version == '{version}'" for version, names in EXTRA_FOR_PYTHON.items() for name in names]
    (out / "requirements.txt").write_text("\n".join([*REQUIREMENTS, *extras]) + "\n")
    size = total_size(out)
    print(f"{out}: {len(os.listdir(out / 'wheels'))} wheels, {size / 2**20:.1f} MiB")
    if size > SIZE_LIMIT:
        raise SystemExit(f"the bundle is {size / 2**20:.1f} MiB, over the {SIZE_LIMIT // 2**20} MiB budget")
    return 0


if __name__ == "__main__":
    sys.exit(main())
