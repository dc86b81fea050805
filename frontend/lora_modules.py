"""The LoRA adapters a frontend serves by name (vLLM's --lora-modules): a request whose
`model` is an adapter's name runs with that adapter (its LoRARequest goes with it to the
scheduler and worker); /v1/models lists each adapter with the base model as its `parent`.

A module is NAME=PATH, or vLLM's JSON '{"name": ..., "path": ..., "base_model_name": ...}'
(the base model's name is not checked, as in vLLM). Adapters are checked here as far as
possible without the model (common.lora_request.check_adapter_files: the files, the config,
the rank against --max-lora-rank, the targets, the weights' names and ranks), so a bad one
fails at start, or, loaded at run time, with a 400. What only the model's shapes reveal
fails the requests using the adapter (400), never the worker.
"""
from __future__ import annotations

import argparse
import json
import os

from common.errors import InvalidRequestError
from common.cli_args import env_default
from common.lora_request import LoRAAdapterError, LoRARequest, check_adapter_files


def parse_lora_module(text: str) -> tuple[str, str]:
    """'name=path' or vLLM's JSON form -> (name, path); argparse turns the error into a usage line."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
            return str(value["name"]), str(value["path"])
        except (ValueError, KeyError, TypeError):
            raise argparse.ArgumentTypeError(f'not a LoRA module JSON with "name" and "path": {text!r}') from None
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"a LoRA module is NAME=PATH, got {text!r}")
    return name, path


def add_lora_module_args(group) -> None:
    group.add_argument("--lora-modules", type=parse_lora_module, nargs="+", default=[], metavar="NAME=PATH",
                       help="LoRA adapters served under their names (needs --enable-lora on the engine)")


def add_max_lora_rank_arg(group) -> None:
    """The frontend's copy of the engine's --max-lora-rank (serve hands it on; same env default)."""
    group.add_argument("--max-lora-rank", type=int, default=int(env_default("MAX_LORA_RANK", 16)),
                       help="refuse LoRA adapters of a higher rank (the engine's --max-lora-rank; default %(default)s)")


def lora_modules_argv(args: argparse.Namespace) -> list[str]:
    """The frontend flags for `serve`'s LoRA settings: its modules and the engine's max rank."""
    modules = getattr(args, "lora_modules", None) or []
    argv = ["--lora-modules", *(f"{name}={os.path.abspath(path)}" for name, path in modules)] if modules else []
    rank = getattr(args, "max_lora_rank", None)
    return argv + (["--max-lora-rank", str(rank)] if rank is not None else [])


def check_adapter_dir(path: str, max_rank: int | None = None) -> None:
    """InvalidRequestError unless `path` holds a PEFT LoRA adapter this engine can serve."""
    try:
        check_adapter_files(path, max_rank)
    except (LoRAAdapterError, OSError) as e:
        raise InvalidRequestError(str(e), param="lora_path") from None


class LoRAModules:
    """name -> LoRARequest of every adapter served, with ids 1, 2, ... in order of adding. An id
    is never reused: a name unloaded and loaded again is a new adapter to the worker and the
    prefix cache, even at the same path (its files may have changed)."""

    def __init__(self, modules: list[tuple[str, str]] = (), max_rank: int | None = None):
        self.requests: dict[str, LoRARequest] = {}
        self.max_rank = max_rank
        self._next_id = 1
        for name, path in modules:
            self.add(name, path)

    def add(self, name: str, path: str) -> LoRARequest:
        if name in self.requests:
            raise InvalidRequestError(f"a LoRA adapter named {name!r} is already loaded", param="lora_name")
        check_adapter_dir(path, self.max_rank)
        request = LoRARequest(name, self._next_id, os.path.abspath(path))
        self._next_id += 1
        self.requests[name] = request
        return request

    def remove(self, name: str) -> LoRARequest | None:
        return self.requests.pop(name, None)
