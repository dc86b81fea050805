"""`pagedserve generate`: offline generation; only the generated text goes to stdout."""
from __future__ import annotations

import sys

from common.cli_args import SettingsParser, add_engine_args, engine_config_from_args, parse_engine_args
from common.errors import USAGE_ERROR, ConfigError, InvalidRequestError
from common.logging_setup import setup_logging


def build_parser() -> SettingsParser:
    parser = SettingsParser(prog="pagedserve generate", description=__doc__)
    parser.add_argument("--prompt", action="append", required=True,
                        help="prompt text (repeat for several prompts)")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt as a user chat message")
    parser.add_argument("--system", default=None, help="system message for --chat")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--sampling-seed", type=int, default=None, dest="sampling_seed",
                        help="per-request sampling seed (default: the engine --seed)")
    parser.add_argument("--ignore-eos", action="store_true")
    return add_engine_args(parser)


def main(argv: list[str] | None = None) -> int:
    args = parse_engine_args(build_parser(), argv)  # a setting that cannot run is a usage error (exit 2)
    setup_logging("generate", "WARNING")
    from common.sampling_params import SamplingParams
    from pagedserve.offline.llm import LLM

    config = engine_config_from_args(args)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            seed=args.sampling_seed if args.sampling_seed is not None else args.seed,
                            max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    try:
        params.validate()
        llm = LLM.from_config(config)
        if args.chat:
            system = [{"role": "system", "content": args.system}] if args.system else []
            conversations = [system + [{"role": "user", "content": p}] for p in args.prompt]
            outputs = llm.chat(conversations, params, use_tqdm=False)
        else:
            outputs = llm.generate(args.prompt, params, use_tqdm=False)
    except InvalidRequestError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 2
    except ConfigError as e:  # a model that cannot be had (not on the Hub, offline) or run: one line
        print(f"pagedserve generate: error: {e}", file=sys.stderr)
        return USAGE_ERROR
    for out in outputs:
        print(out.outputs[0].text)
    return 0
