"""The LoRA adapters a frontend serves by name (vLLM's --lora-modules): a request whose
`model` is an adapter's name runs with that adapter (its LoRARequest goes with it to the
scheduler and worker); /v1/models lists each adapter with the base model as its `parent`.

A module is NAME=PATH, or vLLM's JSON '{"name": ..., "path": ..., "base_model_name": ...}'.
Paths are checked here (a PEFT directory with adapter_config.json), so a bad one fails at
start (or, loaded at run time, with a 400), not inside the worker's step.
"""
from __future__ import annotations

import argparse
import json
import os

from common.errors import InvalidRequestError
from common.lora_request import LoRAAdapterError, LoRARequest, read_adapter_config


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


def lora_modules_argv(args: argparse.Namespace) -> list[str]:
    modules = getattr(args, "lora_modules", None) or []
    return ["--lora-modules", *(f"{name}={os.path.abspath(path)}" for name, path in modules)] if modules else []


def check_adapter_dir(path: str) -> None:
    """InvalidRequestError unless `path` holds a PEFT LoRA adapter of supported settings."""
    try:
        read_adapter_config(path)
    except LoRAAdapterError as e:
        raise InvalidRequestError(str(e), param="lora_path") from None
    if not os.path.isfile(os.path.join(path, "adapter_model.safetensors")):
        raise InvalidRequestError(f"LoRA adapter {path!r}: no adapter_model.safetensors", param="lora_path")


class LoRAModules:
    """name -> LoRARequest of every adapter served, with ids 1, 2, ... in order of adding."""

    def __init__(self, modules: list[tuple[str, str]] = ()):
        self.requests: dict[str, LoRARequest] = {}
        self._next_id = 1
        for name, path in modules:
            self.add(name, path)

    def add(self, name: str, path: str) -> LoRARequest:
        if name in self.requests:
            raise InvalidRequestError(f"a LoRA adapter named {name!r} is already loaded", param="lora_name")
        check_adapter_dir(path)
        request = LoRARequest(name, self._next_id, os.path.abspath(path))
        self._next_id += 1
        self.requests[name] = request
        return request

    def remove(self, name: str) -> LoRARequest | None:
        return self.requests.pop(name, None)
