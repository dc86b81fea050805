"""Models named by a Hugging Face Hub id (`ORG/NAME`, `ORG/NAME@REVISION`).

Fetched with huggingface_hub into its usual cache (HF_HUB_CACHE, else HF_HOME/hub),
only the files serving needs; HF_TOKEN and HF_HUB_OFFLINE are honoured as everywhere.
Both are read when a model is resolved, not when huggingface_hub was imported, so a
process (or test) that sets them late still gets them. Every failure is a ConfigError
of one line naming the model and the cause.
"""
from __future__ import annotations

import os
import re

from common.errors import ConfigError

# What a model directory needs: config, generation defaults, tokenizer and chat template,
# safetensors weights and their index. Never *.bin / *.pt (pickles) or other formats.
MODEL_FILE_PATTERNS = (
    "config.json", "generation_config.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
    "preprocessor_config.json", "processor_config.json",  # vision-language models' image processor
    "*.safetensors", "model.safetensors.index.json",
)
TOKENIZER_FILE_PATTERNS = tuple(p for p in MODEL_FILE_PATTERNS if "safetensors" not in p)

# ORG/NAME as the Hub spells repository ids, optionally @REVISION (a branch, tag or commit).
_HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*)(?:@(?P<revision>[^\s@]+))?")
_TRUE_WORDS = ("1", "on", "yes", "true")


def parse_hub_id(name: str) -> tuple[str, str | None] | None:
    """(repo id, revision or None) when `name` reads as a Hub id, else None."""
    match = _HUB_ID.fullmatch(name.strip())
    if match is None or match.group("repo").lower().endswith(".gguf"):
        return None
    return match.group("repo"), match.group("revision")


def hub_repo_and_revision(name: str, revision: str | None) -> tuple[str, str | None]:
    """The repo id and revision of `name`, which must be a Hub id; `revision` (--revision)
    applies when the name carries none, and must agree when it does."""
    parsed = parse_hub_id(name)
    if parsed is None:
        raise ConfigError(f"{name!r} is not a Hugging Face Hub id (ORG/NAME or ORG/NAME@REVISION)")
    repo, in_name = parsed
    if in_name and revision and in_name != revision:
        raise ConfigError(f"model {name!r} names revision {in_name!r} but --revision is {revision!r}; give one")
    return repo, in_name or revision


def hub_cache_dir() -> str:
    """Where huggingface_hub keeps downloads: HF_HUB_CACHE, else HF_HOME/hub (~/.cache/huggingface/hub)."""
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
    return os.path.expanduser(os.environ.get("HF_HUB_CACHE") or os.path.join(home, "hub"))


def hub_offline() -> bool:
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().lower() in _TRUE_WORDS


def _describe(repo: str, revision: str | None) -> str:
    return f"{repo!r}" + (f" (revision {revision!r})" if revision else "")


def _cause(error: Exception, repo: str, revision: str | None, cache: str) -> str:
    """The reason for `error` from huggingface_hub, in words, on one line."""
    from huggingface_hub import errors

    status = getattr(getattr(error, "response", None), "status_code", None)
    if isinstance(error, errors.GatedRepoError):
        return "the repository is gated: accept its terms on huggingface.co and set HF_TOKEN to a token with access"
    if isinstance(error, errors.RepositoryNotFoundError):
        return "no such repository on the Hub, or it is private (set HF_TOKEN to a token with access)"
    if isinstance(error, errors.RevisionNotFoundError):
        return f"the repository has no revision {revision!r}"
    if status in (401, 403):
        return f"the Hub refused access (HTTP {status}): check HF_TOKEN"
    if isinstance(error, errors.LocalEntryNotFoundError):
        if hub_offline():
            return f"HF_HUB_OFFLINE is set and it is not in the cache at {cache}"
        reason = error.__cause__ or error.__context__
        detail = f" ({type(reason).__name__})" if reason is not None else ""
        return f"the Hub cannot be reached{detail} and it is not in the cache at {cache}"
    if isinstance(error, errors.HFValidationError):
        return f"not a valid repository id: {error}"
    return f"{type(error).__name__}: {error}"


def download_hub_files(name: str, revision: str | None = None, patterns: tuple[str, ...] = MODEL_FILE_PATTERNS
                       ) -> str:
    """The local snapshot directory of Hub model `name` (ORG/NAME[@REV]) holding the files
    matching `patterns`, downloaded now unless cached. ConfigError (one line) on failure."""
    from huggingface_hub import snapshot_download

    repo, revision = hub_repo_and_revision(name, revision)
    cache = hub_cache_dir()
    try:
        return snapshot_download(repo, revision=revision, cache_dir=cache, allow_patterns=list(patterns),
                                 local_files_only=hub_offline(), token=os.environ.get("HF_TOKEN") or None)
    except Exception as error:  # huggingface_hub's errors, network errors: all reported the same way
        message = _cause(error, repo, revision, cache).replace("\n", " ")
        raise ConfigError(f"cannot get model {_describe(repo, revision)} from the Hugging Face Hub: "
                          f"{message}") from None


def download_hub_gguf(name: str, gguf_file: str, revision: str | None = None) -> str:
    """The local path of `gguf_file` from Hub repository `name`, downloaded now unless cached
    (only that file: a GGUF repository usually holds many quantizations)."""
    if not gguf_file.lower().endswith(".gguf") or os.path.isabs(gguf_file) or ".." in gguf_file.split("/"):
        raise ConfigError(f"--gguf-file must be the name of a .gguf file in the repository, got {gguf_file!r}")
    snapshot = download_hub_files(name, revision, (gguf_file,))
    path = os.path.join(snapshot, gguf_file)
    if not os.path.isfile(path):
        repo, revision = hub_repo_and_revision(name, revision)
        where = "in the cache (HF_HUB_OFFLINE is set)" if hub_offline() else "in the repository"
        raise ConfigError(f"cannot get {gguf_file!r} of model {_describe(repo, revision)} from the Hugging Face "
                          f"Hub: no such file {where}")
    return path
