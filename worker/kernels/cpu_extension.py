"""The loader of the CPU kernel extension: the C++ files of worker/csrc (paged attention,
the K/V cache write, the greedy near-tie scan, random sampling, sampled tokens' logprobs,
the rotary embedding, the packed matmuls and the screened greedy lm_heads), compiled with
the local C++ compiler at first use by `torch.utils.cpp_extension.load`, cached on disk,
and optional.

The build (once per machine and source version) goes to torch's extension cache
(`TORCH_EXTENSIONS_DIR`, default ~/.cache/torch_extensions). The cache name carries a
digest of every file under worker/csrc, the flags, this CPU's feature flags and torch's
version, because `-march=native` code must never be loaded on a different CPU. Any
failure (no compiler, no headers, a compile error) is logged once with the compiler's
first error (file:line of the .cpp or .h) and the callers fall back to plain PyTorch;
`PAGEDSERVE_CPU_KERNELS=0` skips the kernels altogether.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from common.config import cpu_flags  # noqa: F401  (cpu_ops reads it here)
from common.config import cpu_flags_line as _cpu_flags  # part of the build's digest

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent.parent / "csrc"
NAME_PREFIX = "pagedserve_cpu_kernels"
ENV_SWITCH = "PAGEDSERVE_CPU_KERNELS"
# -fopenmp makes at::parallel_for (inline in ATen's headers) parallel; the extension's
# libgomp.so.1 resolves to the copy torch already loaded, so there is one thread pool.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math", "-fno-finite-math-only"]
LDFLAGS = ["-fopenmp"]
GUARD_FILE = "pagedserve-build.flock"


class KernelBuildError(RuntimeError):
    """The extension did not build; the message names the compiler's first errors (file:line)."""


_lock = threading.Lock()
_module: Any = None
_failed = False
_failure: str | None = None


def source_files(csrc: Path | None = None) -> list[Path]:
    """The translation units of the extension: every .cpp under `csrc` (default CSRC), in name order."""
    return sorted((csrc or CSRC).glob("*.cpp"))


def extension_name(flags: Sequence[str] = CFLAGS, csrc: Path | None = None, prefix: str = NAME_PREFIX) -> str:
    """The cache name of a build: a digest of every .cpp and .h under `csrc` (names and
    contents), the flags, this CPU's feature flags, torch's version and where the sources are
    (torch's build files name the source paths: two checkouts sharing a build directory
    would rebuild it in turn, each invalidating the other's)."""
    csrc = csrc or CSRC
    digest = hashlib.sha256(str(csrc.resolve()).encode())
    for path in sorted([*csrc.glob("*.cpp"), *csrc.glob("*.h")]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update("\n".join([" ".join([*flags, *LDFLAGS]), _cpu_flags(), torch.__version__]).encode())
    return f"{prefix}_{digest.hexdigest()[:12]}"


def compiler_present() -> bool:
    """Whether the C++ compiler torch builds with (`CXX`, default `c++`) is on PATH."""
    return shutil.which(os.environ.get("CXX", "c++")) is not None


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").lower() not in ("0", "false", "no", "off")


def expected() -> bool:
    """Whether the extension should build here: the switch is on and a compiler is present.
    Where this holds, a failed build is a bug, not a reason to skip."""
    return enabled() and compiler_present()


@contextlib.contextmanager
def _exclusive_build(name: str) -> Iterator[str]:
    """Hold the build directory against other processes, with a lock the kernel drops when its holder dies.

    torch's own lock is a file: a build killed midway (a worker restarted during
    its first start) leaves it behind, and every later load then waits for it
    forever. Every build here takes this flock first, so while we hold it
    torch's lock file can only be a dead build's, and is removed.
    """
    from torch.utils.cpp_extension import _get_build_directory
    build_dir = _get_build_directory(name, verbose=False)
    os.makedirs(build_dir, exist_ok=True)
    with open(os.path.join(build_dir, GUARD_FILE), "a") as guard:
        try:
            fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("Waiting for another process that is building the CPU kernels...")
            fcntl.flock(guard, fcntl.LOCK_EX)
        torch_lock = os.path.join(build_dir, "lock")
        if os.path.exists(torch_lock):
            logger.warning("removing the lock file of a kernel build that was killed midway: %s", torch_lock)
            with contextlib.suppress(OSError):
                os.remove(torch_lock)
        yield build_dir


def _first_errors(message: str, limit: int = 5) -> str:
    """The compiler's first error lines (`path/file.cpp:line:col: error: ...`) of a build log."""
    errors = [line.strip() for line in message.splitlines() if "error" in line and ": " in line
              and not line.lstrip().startswith(("FAILED:", "ninja:", "Error building"))]
    return "\n".join(errors[:limit])


def build(flags: Sequence[str] = CFLAGS, csrc: Path | None = None, prefix: str = NAME_PREFIX) -> Any:
    """Compile (or load from the cache) the extension from the .cpp files of `csrc` with `flags`.

    Raises KernelBuildError, its message the compiler's first errors with their file:line,
    when the build fails. A build with other flags (e.g. without AVX-512) needs its own
    `prefix`, and `-DPAGEDSERVE_OPS=<name>` to load into a process that holds this one.
    """
    from torch.utils.cpp_extension import load as load_extension
    csrc = csrc or CSRC
    name = extension_name(flags, csrc, prefix)
    with _exclusive_build(name) as build_dir:
        if not os.path.exists(os.path.join(build_dir, f"{name}.so")):  # else torch only loads it
            logger.info("Building the CPU kernels %s (first use on this machine)...", name)
        try:
            # Copies of the flag lists: torch appends to the lists it is given, which would change
            # the next build's cache name.
            return load_extension(name=name, sources=[str(path) for path in source_files(csrc)],
                                  extra_include_paths=[str(csrc)], extra_cflags=list(flags),
                                  extra_ldflags=list(LDFLAGS), verbose=False)
        except Exception as exc:
            text = str(exc).strip()
            raise KernelBuildError(f"building {name} failed:\n{_first_errors(text) or text[-2000:]}") from exc


def load() -> Any | None:
    """The compiled extension module, or None when it is disabled or cannot be built (see failure())."""
    global _module, _failed, _failure
    if _module is not None or _failed:
        return _module
    with _lock:
        if _module is not None or _failed:
            return _module
        if not enabled():
            _failed = True
            _failure = f"{ENV_SWITCH}=0"
            return None
        try:
            _module = build()
            # Loading the library defined these operators; compiled graphs trace them with their fakes.
            torch.library.register_fake("pagedserve::packed_linear")(_packed_linear_shape)
            torch.library.register_fake("pagedserve::packed_linear_silu")(_packed_linear_shape)
            torch.library.register_fake("pagedserve::rotary_qk")(_rotary_qk_shapes)
            torch.library.register_fake("pagedserve::gguf_linear")(_packed_linear_shape)
            torch.library.register_fake("pagedserve::gguf_linear_silu")(_packed_linear_shape)
        except Exception as exc:  # no compiler, headers or a build error: plain PyTorch still works
            _failed = True
            _failure = str(exc).strip() or type(exc).__name__
            logger.warning("CPU kernels unavailable, using the PyTorch fallback: %s", _failure)
    return _module


def require() -> Any:
    """The compiled extension module; raises KernelBuildError (with failure()) when there is none."""
    module = load()
    if module is None:
        raise KernelBuildError(f"the CPU kernels are unavailable: {_failure}")
    return module


def failure() -> str | None:
    """Why load() returned None (the switch, or the build's first errors); None otherwise."""
    return _failure


def _rotary_qk_shapes(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
                      kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, dim = qkv.shape[0], cos.shape[-1]
    return qkv.new_empty((tokens, heads, dim)), qkv.new_empty((tokens, kv_heads, dim))


def _packed_linear_shape(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                         bias: torch.Tensor | None, dense: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))
