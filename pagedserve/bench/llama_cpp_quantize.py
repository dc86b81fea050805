"""Quantize a GGUF file with llama.cpp's quantizer and print one JSON line.

`pagedserve bench make-gguf` runs this file by path with the interpreter of a
venv that has llama-cpp-python (scripts/install_llama_cpp_python.sh makes
one), so it imports nothing from pagedserve:

    <llama-cpp python> llama_cpp_quantize.py --input F32.gguf --output Q8_0.gguf --type Q8_0 [--pure]

--type is a llama_ftype name without its LLAMA_FTYPE_MOSTLY_ prefix (Q8_0,
Q4_0, Q4_1, Q4_K_M, Q6_K, ...). llama.cpp keeps norms in F32 and, for a row
length that is no multiple of its 256-wide k-quant blocks, falls back to
another type (Q4_K -> Q5_0, Q6_K -> Q8_0); --pure only stops its mixing of
types (Q4_K_M's Q6_K tensors).
"""
import argparse
import ctypes
import json
import os


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--type", required=True)
    parser.add_argument("--pure", action="store_true", help="one type for every quantized tensor")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    args = parser.parse_args()
    import llama_cpp

    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{args.type.upper()}", None)
    if ftype is None:
        raise SystemExit(f"error: llama.cpp has no quantization type {args.type!r}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = args.threads
    params.pure = args.pure
    rc = llama_cpp.llama_model_quantize(args.input.encode(), args.output.encode(), ctypes.byref(params))
    if rc != 0:
        raise SystemExit(f"error: llama_model_quantize returned {rc}")
    print(json.dumps({"output": args.output, "type": args.type.upper(), "bytes": os.path.getsize(args.output),
                      "llama_cpp_python": llama_cpp.__version__}))


if __name__ == "__main__":
    main()
