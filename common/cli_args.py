"""Engine flags shared by every command that runs a model (`vllm serve` names)."""
from __future__ import annotations

import argparse
import logging
import os
import re
import json
import sys
from typing import NoReturn

from common.config import KV_CACHE_DTYPES, QUANTIZATIONS, EngineConfig
from common.errors import ConfigError
from common.media_args import add_limit_mm_arg

_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
               "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40,
               "tib": 1 << 40}


def parse_size(text: str) -> int:
    """'4GiB', '512M', '1.5g' or a byte count -> bytes. A bare number below
    1024 is taken as GiB, like VLLM_CPU_KVCACHE_SPACE."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"not a memory size: {text!r} (try 4GiB or 512MiB)")
    number, unit = float(match.group(1)), match.group(2).lower()
    if unit == "" and number < 1024:
        unit = "gib"
    return int(number * _SIZE_UNITS[unit])


def _number(kind, text: str, ok, wanted: str):
    try:
        value = kind(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"must be {wanted}, got {text!r}")
    return value


# Flag types: argparse turns their errors (and those of a PAGEDSERVE_* default,
# which it converts the same way) into a usage line naming the flag.
def port_number(text: str) -> int:
    return _number(int, text, lambda v: 0 <= v <= 65535, "a port number, 0-65535 (0 = any free port)")


def positive_float(text: str) -> float:
    return _number(float, text, lambda v: v > 0, "a positive number")


def non_negative_float(text: str) -> float:
    return _number(float, text, lambda v: v >= 0, "0 or more")


def _positive_int(text: str) -> int:
    return _number(int, text, lambda v: v >= 1, "1 or more")


def non_negative_int(text: str) -> int:
    return _number(int, text, lambda v: v >= 0, "0 or more")


class EnvText(str):
    """A flag default read from PAGEDSERVE_<NAME>: it remembers the variable, so a
    usage error about it can name the variable the operator set, not only the flag."""
    variable: str


def _from_env(name: str) -> EnvText | None:
    value = os.environ.get(f"PAGEDSERVE_{name}")
    if value is None:
        return None
    text = EnvText(value)
    text.variable = f"PAGEDSERVE_{name}"
    return text


def log_level(text: str) -> str:
    """A logging level name, e.g. debug or INFO."""
    if not isinstance(logging.getLevelName(text.strip().upper()), int):
        raise argparse.ArgumentTypeError(f"not a log level: {text!r} (DEBUG, INFO, WARNING, ERROR)")
    return text.strip().upper()


def env_default(name: str, default):
    """Flag default from PAGEDSERVE_<NAME> when set (compose passes settings this way).
    Pass the text through as the default: argparse converts it with the flag's
    type, so a bad value is a usage error naming the flag, not a traceback."""
    value = _from_env(name)
    return default if value is None else value


def env_setting(name: str, default):
    """As env_default, but an empty PAGEDSERVE_<NAME> is the default: compose
    passes `${VAR:-}` (empty) for a setting the operator left unset."""
    return _from_env(name) or default


_FALSE_WORDS = ("", "0", "false", "no", "off")


def env_switch(name: str) -> bool:
    """A store_true flag's default from PAGEDSERVE_<NAME>: "False", "no", "off",
    "0" or empty (any case) are off, since operators write them to mean off."""
    return os.environ.get(f"PAGEDSERVE_{name}", "").strip().lower() not in _FALSE_WORDS


class SettingsParser(argparse.ArgumentParser):
    """The parser of every command: its usage errors name the PAGEDSERVE_* variable
    a bad value came from, and a value from the environment must be one of the
    flag's choices (argparse checks choices only on the command line). With
    `raise_errors`, a usage error raises ConfigError instead of exiting: `serve`
    parses each component's settings this way before starting any."""
    raise_errors = False

    def parse_known_args(self, args: list[str] | None = None, namespace: argparse.Namespace | None = None
                         ) -> tuple[argparse.Namespace, list[str]]:
        self._given = list(sys.argv[1:] if args is None else args)  # what came from the command line
        parsed, extras = super().parse_known_args(args, namespace)
        for action in self._actions:
            value = getattr(parsed, action.dest, None)
            if action.choices is not None and isinstance(value, EnvText) and value not in action.choices:
                self.error(f"argument {'/'.join(action.option_strings)}: invalid choice: {str(value)!r} "
                           f"(choose from {', '.join(map(str, action.choices))})")
            if isinstance(value, EnvText):  # plain text from here on: msgspec encodes no str subclass
                setattr(parsed, action.dest, str(value))
        return parsed, extras

    def error(self, message: str) -> NoReturn:
        origin = self._env_origin(message)
        if self.raise_errors:
            raise ConfigError(message + origin)
        if origin:  # one line: the usage of the command line says nothing about the environment
            self.exit(2, f"{self.prog}: error: {message}{origin}\n")
        super().error(message)

    def _env_origin(self, message: str) -> str:
        """' (from PAGEDSERVE_X)' when `message` is about a flag that took its bad value from the environment."""
        match = re.match(r"argument ([^:]+): ", message)
        given = getattr(self, "_given", [])
        for action in self._actions if match else []:
            variable = getattr(action.default, "variable", None)
            if ("/".join(action.option_strings) == match.group(1) and variable
                    and not any(arg.split("=", 1)[0] in action.option_strings for arg in given)):
                return f" (from {variable} in the environment)"
        return ""


def add_log_level_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """--log-level, every component's (setup_logging reads the variable only where no parser does)."""
    parser.add_argument("--log-level", type=log_level, default=env_setting("LOG_LEVEL", None),
                        help="DEBUG, INFO, ... (default INFO; env PAGEDSERVE_LOG_LEVEL)")


MODEL_HELP = ("a Hugging Face model directory, a .gguf file, the alias smollm2-135m-instruct, or a Hugging Face "
              "Hub id ORG/NAME[@REVISION] (fetched into the Hub cache: HF_HOME, HF_TOKEN, HF_HUB_OFFLINE apply; "
              "a local directory of the same name wins)")


def add_model_source_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """--revision and --gguf-file: which files of a Hub model (every command that takes --model)."""
    parser.add_argument("--revision", default=env_setting("REVISION", None),
                        help="the branch, tag or commit of a Hub model (default main; env PAGEDSERVE_REVISION)")
    parser.add_argument("--gguf-file", default=env_setting("GGUF_FILE", None), metavar="NAME.gguf",
                        help="serve this one .gguf of the Hub repository (or local directory) --model names, "
                             "downloading only it (env PAGEDSERVE_GGUF_FILE)")


def add_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    d = EngineConfig.__dataclass_fields__
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=env_default("MODEL", d["model"].default),
                   help=MODEL_HELP + " (default: smollm2-135m-instruct)")
    add_model_source_args(g)
    g.add_argument("--tokenizer", default=env_setting("TOKENIZER", None),
                   help="read and write text with this tokenizer (a directory or Hub id) instead of the model's "
                        "(env PAGEDSERVE_TOKENIZER)")
    g.add_argument("--tokenizer-revision", default=None, help="the branch, tag or commit of a Hub --tokenizer")
    g.add_argument("--trust-remote-code", action="store_true", default=env_switch("TRUST_REMOTE_CODE"),
                   help="accepted as in vLLM; no code from a model repository is ever run (an architecture "
                        "pagedserve does not implement is refused with the list of those it does)")
    g.add_argument("--dtype", default=env_default("DTYPE", "auto"), choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--kv-cache-dtype", default=env_default("KV_CACHE_DTYPE", "auto"), choices=list(KV_CACHE_DTYPES),
                   help="the KV cache's element type: auto (the model's), bfloat16 (half a float32 model's "
                        "cache: twice the tokens, faster decoding, attention over rounded K/V), or 8-bit floats "
                        "fp8 (= fp8_e4m3) / fp8_e5m2 (half a 16-bit cache, per-layer scales: 1.0 unless the "
                        "checkpoint has k_scale/v_scale)")
    g.add_argument("--quantization", "-q", default=env_default("QUANTIZATION", None), choices=list(QUANTIZATIONS),
                   help="how linear weights are kept and multiplied: int8 (W8A8: int8 weights and per-token int8 "
                        "activations), gguf (a .gguf model's quantized blocks, the default for .gguf models) or "
                        "none (weights at --dtype; a .gguf model dequantized at load)")
    g.add_argument("--device", default=env_default("DEVICE", "auto"), choices=["auto", "cpu", "cuda"])
    g.add_argument("--attention-backend", default=env_default("ATTENTION_BACKEND", "auto"),
                   choices=["auto", "torch", "triton"])
    g.add_argument("--block-size", type=int, default=env_default("BLOCK_SIZE", None) or None,
                   help="tokens per KV cache block (default: 16 on CUDA; on CPU 64 in float32, 128 in 16-bit)")
    g.add_argument("--kv-cache-memory", type=parse_size, default=env_default("KV_CACHE_MEMORY", "4GiB"),
                   help="KV cache size on CPU, e.g. 4GiB (default 4GiB)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="use exactly this many KV blocks (testing)")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=env_default("MAX_NUM_SEQS", 256))
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-logprobs", type=int, default=env_default("MAX_LOGPROBS", d["max_logprobs"].default),
                   help="the most logprobs / prompt_logprobs a request may ask for per token; -1: the whole "
                        "vocabulary (default 20; env PAGEDSERVE_MAX_LOGPROBS)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="never compile the model step; on CUDA, no CUDA graphs either")
    g.add_argument("--max-cudagraph-batch-size", type=int, default=None,
                   help="CUDA: decode batches of up to this many sequences (at most --max-num-seqs) replay CUDA "
                        "graphs captured at sizes 1, 2, 4, 8, 16, ... (default 256; 0: none)")
    g.add_argument("--greedy-rescore-near-ties", action="store_true",
                   help="bfloat16/float16 models: greedy settles near ties of the top logits by float32 dot "
                        "products (closer to float32's tokens); default off: the argmax, as vLLM")
    g.add_argument("--tensor-parallel-size", "-tp", type=_positive_int,
                   default=env_default("TENSOR_PARALLEL_SIZE", 1),
                   help="worker ranks sharing each layer (attention heads, MLP columns, vocabulary)")
    g.add_argument("--pipeline-parallel-size", "-pp", type=_positive_int,
                   default=env_default("PIPELINE_PARALLEL_SIZE", 1),
                   help="worker ranks each holding a consecutive share of the layers")
    g.add_argument("--data-parallel-size", "-dp", type=_positive_int, default=env_default("DATA_PARALLEL_SIZE", 1),
                   help="engine replicas (a scheduler and its worker group each) behind the frontends")
    g.add_argument("--distributed-init-method", default=env_default("DISTRIBUTED_INIT_METHOD", None),
                   help="where a worker group meets: tcp://HOST:PORT of rank 0 (default: torchrun's "
                        "MASTER_ADDR and MASTER_PORT)")
    g.add_argument("--speculative-config", default=env_setting("SPECULATIVE_CONFIG", None),
                   help='speculative decoding, as vLLM\'s JSON: \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' or \'{"method": "draft_model", '
                        '"model": PATH, "num_speculative_tokens": 4}\'; optional "disable_by_batch_size"')
    g.add_argument("--runner", default=env_default("RUNNER", "auto"), choices=["auto", "generate", "pooling"],
                   help="pooling: serve embeddings (/v1/embeddings, gRPC Embed); auto: pooling for BertModel")
    g.add_argument("--pooler-config", default=env_setting("POOLER_CONFIG", None),
                   help='the pooling of a pooling model, as vLLM\'s JSON: \'{"pooling_type": "MEAN", '
                        '"normalize": true}\' (LAST, MEAN or CLS; default: the model\'s sentence-transformers files)')
    g.add_argument("--enable-lora", action="store_true", default=env_switch("ENABLE_LORA"),
                   help="serve LoRA adapters (PEFT, on q/k/v/o and gate/up/down) next to the base model")
    g.add_argument("--max-loras", type=_positive_int, default=env_default("MAX_LORAS", 1),
                   help="LoRA: the most distinct adapters one step runs (device slots; default %(default)s)")
    g.add_argument("--max-lora-rank", type=_positive_int, default=env_default("MAX_LORA_RANK", 16),
                   help="LoRA: the largest adapter rank accepted (default %(default)s)")
    g.add_argument("--max-cpu-loras", type=_positive_int, default=env_default("MAX_CPU_LORAS", None),
                   help="LoRA: adapters kept loaded in the worker, least recently used dropped (default: --max-loras)")
    g.add_argument("--model-cache-dir", default=env_default("CACHE_DIR", None),
                   help="where converted GGUF models are kept (default ~/.cache/pagedserve/models)")
    add_limit_mm_arg(g)
    return parser


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine flags as a config; ConfigError for a combination that cannot run."""
    kv = args.kv_cache_memory
    return EngineConfig(
        model=args.model, revision=args.revision, gguf_file=args.gguf_file, tokenizer=args.tokenizer,
        tokenizer_revision=args.tokenizer_revision, trust_remote_code=args.trust_remote_code,
        dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, device=args.device,
        quantization=args.quantization,
        attention_backend=args.attention_backend,
        block_size=args.block_size, kv_cache_memory=kv if isinstance(kv, int) else parse_size(kv),
        gpu_memory_utilization=args.gpu_memory_utilization,
        num_gpu_blocks_override=args.num_gpu_blocks_override, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching, seed=args.seed,
        enforce_eager=args.enforce_eager, max_cudagraph_batch_size=args.max_cudagraph_batch_size,
        model_cache_dir=args.model_cache_dir, max_logprobs=args.max_logprobs,
        greedy_rescore_near_ties=args.greedy_rescore_near_ties,
        tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
        data_parallel_size=args.data_parallel_size, distributed_init_method=args.distributed_init_method,
        speculative_config=args.speculative_config, runner=args.runner, pooler_config=args.pooler_config,
        enable_lora=args.enable_lora, max_loras=int(args.max_loras), max_lora_rank=int(args.max_lora_rank),
        max_cpu_loras=None if args.max_cpu_loras is None else int(args.max_cpu_loras),
        limit_mm_per_prompt=getattr(args, "limit_mm_per_prompt", None))


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    try:
        return engine_config(args)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None


def use_local_model(args: argparse.Namespace) -> None:
    """Resolve a Hub model (--model ORG/NAME[@REV], --revision, --gguf-file) now and point the
    flags at its local path: what the command then starts or reads never asks the Hub again."""
    from common.model_files import local_model_source

    config = local_model_source(engine_config(args))
    args.model, args.revision, args.gguf_file = config.model, config.revision, config.gguf_file
    args.tokenizer, args.tokenizer_revision = config.tokenizer, config.tokenizer_revision


def parse_engine_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse a command with the engine flags: a config that cannot run is a usage error."""
    args = parser.parse_args(argv)
    try:
        engine_config(args)
    except ConfigError as e:
        parser.error(str(e))
    return args


def engine_argv(config: EngineConfig) -> list[str]:
    """The flags that recreate `config` (used by `serve` to start components)."""
    argv = ["--model", config.model, "--dtype", config.dtype, "--kv-cache-dtype", config.kv_cache_dtype,
            "--device", config.device,
            "--attention-backend", config.attention_backend, "--block-size", str(config.block_size),
            "--kv-cache-memory", str(config.kv_cache_memory), "--max-num-seqs", str(config.max_num_seqs),
            "--seed", str(config.seed), "--max-logprobs", str(config.max_logprobs),
            "--enable-prefix-caching" if config.enable_prefix_caching else "--no-enable-prefix-caching"]
    optional = {"--max-model-len": config.max_model_len, "--max-num-batched-tokens": config.max_num_batched_tokens,
                "--num-gpu-blocks-override": config.num_gpu_blocks_override,
                "--max-cudagraph-batch-size": config.max_cudagraph_batch_size,
                "--model-cache-dir": config.model_cache_dir, "--quantization": config.quantization,
                "--distributed-init-method": config.distributed_init_method,
                "--revision": config.revision, "--gguf-file": config.gguf_file, "--tokenizer": config.tokenizer,
                "--tokenizer-revision": config.tokenizer_revision}
    for flag, value in optional.items():
        if value is not None:
            argv += [flag, str(value)]
    if config.speculative_config is not None:
        argv += ["--speculative-config", config.speculative_config.to_json()]
    if config.runner != "auto":
        argv += ["--runner", config.runner]
    if config.pooler_config is not None:
        argv += ["--pooler-config", config.pooler_config.to_json()]
    if config.gpu_memory_utilization != 0.9:
        argv += ["--gpu-memory-utilization", str(config.gpu_memory_utilization)]
    for flag, size in (("--tensor-parallel-size", config.tensor_parallel_size),
                       ("--pipeline-parallel-size", config.pipeline_parallel_size),
                       ("--data-parallel-size", config.data_parallel_size)):
        if size != 1:
            argv += [flag, str(size)]
    if config.enforce_eager:
        argv.append("--enforce-eager")
    if config.trust_remote_code:
        argv.append("--trust-remote-code")
    if config.greedy_rescore_near_ties:
        argv.append("--greedy-rescore-near-ties")
    if config.limit_mm_per_prompt is not None:
        argv += ["--limit-mm-per-prompt", json.dumps(config.limit_mm_per_prompt)]
    if config.enable_lora:
        argv += ["--enable-lora", "--max-loras", str(config.max_loras), "--max-lora-rank", str(config.max_lora_rank)]
        if config.max_cpu_loras is not None:
            argv += ["--max-cpu-loras", str(config.max_cpu_loras)]
    return argv
