"""`pagedserve bench make-gguf`: GGUF files of a model in other quantizations.

    pagedserve bench make-gguf --type Q8_0 --output smollm2-q8_0.gguf
    pagedserve bench make-gguf --type Q4_K --pure --output smollm2-q4_k.gguf --llama-cpp-python PY

The model (default: SmolLM2, whose only source is its Q4_1 file, so every
type is made from those weights) is written as a float32 GGUF with the
tokenizer metadata of its GGUF file, then quantized by llama.cpp's quantizer
run by the interpreter of a venv with llama-cpp-python
(scripts/install_llama_cpp_python.sh). --type F32 stops after the first step.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

DEFAULT_LLAMA_CPP_PYTHON = os.path.expanduser("~/.cache/pagedserve/peers/llama-cpp/bin/python")
QUANTIZE_SCRIPT = Path(__file__).resolve().parent / "llama_cpp_quantize.py"
# Our names -> llama_ftype names; Q4_K is llama.cpp's usual Q4_K_M (--pure: Q4_K wherever the rows allow).
TYPES = {"F32": None, "F16": "F16", "BF16": "BF16", "Q8_0": "Q8_0", "Q4_0": "Q4_0", "Q4_1": "Q4_1",
         "Q5_0": "Q5_0", "Q5_1": "Q5_1", "Q4_K": "Q4_K_M", "Q4_K_S": "Q4_K_S", "Q4_K_M": "Q4_K_M",
         "Q5_K": "Q5_K_M", "Q5_K_M": "Q5_K_M", "Q6_K": "Q6_K"}


def tensor_types(path: str) -> dict[str, int]:
    """How many tensors of each type the GGUF file holds."""
    from gguf import GGUFReader

    return dict(Counter(t.tensor_type.name for t in GGUFReader(path).tensors).most_common())


def _tokenizer_source(model: str, given: str | None) -> str:
    from common.model_files import is_alias, smollm2_gguf_path

    if given:
        return given
    if model.lower().endswith(".gguf"):
        return model
    if is_alias(model):
        return smollm2_gguf_path()
    raise ValueError(f"{model} is no GGUF file: name one with the same tokenizer (--tokenizer-gguf)")


def quantize(llama_python: str, f32_path: str, out_path: str, ftype: str, pure: bool) -> dict:
    from pagedserve.bench.compare import last_json_line

    proc = subprocess.run([llama_python, str(QUANTIZE_SCRIPT), "--input", f32_path, "--output", out_path,
                           "--type", ftype, *(["--pure"] if pure else [])],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"llama.cpp's quantizer failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return last_json_line(proc.stdout)


def cmd_make_gguf(args: argparse.Namespace) -> int:
    from common.model_files import resolve_model_dir
    from pagedserve.bench.gguf_export import write_f32_gguf

    kind = args.type.upper()
    try:
        if kind not in TYPES:
            raise ValueError(f"unknown --type {args.type!r}; choose from {', '.join(TYPES)}")
        llama_python = args.llama_cpp_python or DEFAULT_LLAMA_CPP_PYTHON
        if TYPES[kind] is not None and not os.path.exists(llama_python):
            raise ValueError(f"no llama-cpp-python at {llama_python}: run scripts/install_llama_cpp_python.sh "
                             f"and pass the python it prints (--llama-cpp-python)")
        tokenizer_gguf = _tokenizer_source(args.model, args.tokenizer_gguf)
    except ValueError as exc:
        print(f"pagedserve bench make-gguf: error: {exc}", file=sys.stderr)
        return 2
    model_dir = resolve_model_dir(args.model, args.model_cache_dir)
    name = f"{os.path.basename(os.path.normpath(model_dir))}.{kind}"
    result = {"output": args.output, "type": kind, "source": model_dir}
    if TYPES[kind] is None:
        write_f32_gguf(model_dir, args.output, tokenizer_gguf, name=name)
    else:
        out_dir = os.path.dirname(os.path.abspath(args.output))
        with tempfile.TemporaryDirectory(prefix=".make-gguf-", dir=out_dir) as tmp:
            f32 = write_f32_gguf(model_dir, os.path.join(tmp, "f32.gguf"), tokenizer_gguf, name=name)
            result.update(quantize(llama_python, f32, args.output, TYPES[kind], args.pure))
    result["bytes"] = os.path.getsize(args.output)
    result["tensor_types"] = tensor_types(args.output)
    print(json.dumps(result) if args.json else
          f"wrote {args.output} ({result['bytes'] / 2**20:.1f} MiB), tensors: "
          + ", ".join(f"{n} {t}" for t, n in result["tensor_types"].items()), flush=True)
    return 0


def add_make_gguf_parser(sub) -> None:
    p = sub.add_parser("make-gguf", help="write the model as a GGUF file of another quantization "
                       "(llama.cpp's quantizer)", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--type", required=True, help=f"one of {', '.join(TYPES)}")
    p.add_argument("--output", required=True, help="the .gguf file to write")
    p.add_argument("--pure", action="store_true", help="no mixing of types (Q4_K_M keeps some tensors in Q6_K)")
    p.add_argument("--model", default="smollm2-135m-instruct", help="a llama-architecture model (HF directory, "
                   ".gguf or alias)")
    p.add_argument("--model-cache-dir", default=None)
    p.add_argument("--tokenizer-gguf", default=None, help="GGUF file whose tokenizer metadata is copied "
                   "(default: the model's own GGUF file)")
    p.add_argument("--llama-cpp-python", default=None,
                   help=f"python of a venv with llama-cpp-python (default {DEFAULT_LLAMA_CPP_PYTHON})")
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.set_defaults(handler=cmd_make_gguf)
