"""--limit-mm-per-prompt and --allowed-media-domains: `serve` hands them to the components that
use them (each parsed by that component's own parser), PAGEDSERVE_* variables set them, and a
bad value is a usage error naming the flag."""
from __future__ import annotations

import pytest

from common.errors import ConfigError


def parsed_components(tmp_path, argv: list[str]) -> dict:
    """Each component's settings as its own parser reads the command line serve gives it."""
    import importlib

    from pagedserve.cli import COMMANDS
    from pagedserve.serve import build_parser, component_commands

    parsed = {}
    for component in component_commands(build_parser().parse_args(argv), str(tmp_path)):
        module = importlib.import_module(COMMANDS[component.argv[0]][0])
        parsed[component.name] = module.parse_args(module.build_parser(), component.argv[1:])
    return parsed


def test_serve_hands_the_image_flags_on(tmp_path, monkeypatch):
    from tokenizer_pool.tokenizer_pool_cli import image_limits

    monkeypatch.delenv("PAGEDSERVE_LIMIT_MM_PER_PROMPT", raising=False)
    monkeypatch.delenv("PAGEDSERVE_ALLOWED_MEDIA_DOMAINS", raising=False)
    parsed = parsed_components(tmp_path, ["--limit-mm-per-prompt", '{"image": 3}',
                                          "--allowed-media-domains", "Upload.Wikimedia.org", "127.0.0.1"])
    assert {name: args.limit_mm_per_prompt for name, args in parsed.items()} == \
        {name: {"image": 3} for name in ("tokenizer", "scheduler", "worker", "frontend")}
    limits = image_limits(parsed["tokenizer"])
    assert (limits.max_images, limits.allowed_domains) == (3, ("upload.wikimedia.org", "127.0.0.1"))
    defaults = parsed_components(tmp_path, [])
    limits = image_limits(defaults["tokenizer"])
    assert (limits.max_images, limits.allowed_domains) == (1, ())  # vLLM's one image; no URL fetched
    assert defaults["frontend"].limit_mm_per_prompt is None


def test_the_variables_set_them(monkeypatch):
    from tokenizer_pool.tokenizer_pool_cli import build_parser, image_limits, parse_args

    monkeypatch.setenv("PAGEDSERVE_LIMIT_MM_PER_PROMPT", '{"image": 0}')
    monkeypatch.setenv("PAGEDSERVE_ALLOWED_MEDIA_DOMAINS", "a.example, B.example")
    limits = image_limits(parse_args(build_parser(), []))
    assert (limits.max_images, limits.allowed_domains) == (0, ("a.example", "b.example"))


@pytest.mark.parametrize("argv, flag", [
    (["--limit-mm-per-prompt", "2"], "--limit-mm-per-prompt"),
    (["--limit-mm-per-prompt", '{"video": 1}'], "--limit-mm-per-prompt"),
    (["--limit-mm-per-prompt", '{"image": -1}'], "--limit-mm-per-prompt"),
    (["--allowed-media-domains", "http://x.example/"], "--allowed-media-domains"),
])
def test_bad_values_are_usage_errors(argv, flag):
    from pagedserve.serve import build_parser

    parser = build_parser()
    parser.raise_errors = True
    with pytest.raises(ConfigError, match=flag):
        parser.parse_args(argv)
