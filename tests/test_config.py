"""EngineConfig's device-dependent defaults and its checks."""
from __future__ import annotations

import argparse

import pytest

from common.cli_args import add_engine_args, engine_config_from_args
from common.config import EngineConfig
from common.errors import ConfigError


@pytest.fixture(autouse=True)
def _no_amx(monkeypatch):
    """CPU block sizes depend on AMX: these tests see a CPU without it unless they say so."""
    monkeypatch.setattr("common.config.cpu_flags", lambda: {"avx512f", "avx512_bf16"})


def test_block_size_defaults_to_the_same_bytes_per_block_on_cpu_and_16_on_cuda():
    assert EngineConfig(device="cpu", dtype="bfloat16").block_size == 128
    assert EngineConfig(device="cpu", dtype="float16").block_size == 128
    assert EngineConfig(device="cpu", dtype="float32").block_size == 64
    assert EngineConfig(device="cuda").block_size == 16
    assert EngineConfig(device="cuda", dtype="float32").block_size == 16


def test_amx_cpus_default_to_32_token_blocks(monkeypatch):
    monkeypatch.setattr("common.config.cpu_flags", lambda: {"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
    assert EngineConfig(device="cpu", dtype="bfloat16").block_size == 32
    assert EngineConfig(device="cpu", dtype="float32").block_size == 16
    assert EngineConfig(device="cpu", dtype="bfloat16", kv_cache_dtype="fp8").block_size == 64
    assert EngineConfig(device="cuda").block_size == 16


def test_an_explicit_block_size_is_kept():
    assert EngineConfig(device="cpu", block_size=16).block_size == 16


@pytest.mark.parametrize("bad", [0, 24, -16])
def test_a_block_size_that_is_not_a_power_of_two_is_refused(bad):
    with pytest.raises(ConfigError, match="block_size must be a positive power of two"):
        EngineConfig(device="cpu", block_size=bad)


def test_the_cli_default_follows_the_device_and_the_environment(monkeypatch):
    def parse(*argv: str) -> EngineConfig:
        return engine_config_from_args(add_engine_args(argparse.ArgumentParser()).parse_args(list(argv)))

    assert parse("--device", "cpu", "--dtype", "bfloat16").block_size == 128
    assert parse("--device", "cpu", "--dtype", "float32").block_size == 64
    assert parse("--device", "cpu", "--block-size", "32").block_size == 32
    monkeypatch.setenv("PAGEDSERVE_BLOCK_SIZE", "16")
    assert parse("--device", "cpu").block_size == 16


def test_max_logprobs_from_the_flag_or_the_environment_and_handed_on(monkeypatch):
    from common.cli_args import engine_argv

    def parse(*argv: str) -> EngineConfig:
        return engine_config_from_args(add_engine_args(argparse.ArgumentParser()).parse_args(list(argv)))

    assert parse().max_logprobs == 20 and parse("--max-logprobs", "-1").max_logprobs == -1
    monkeypatch.setenv("PAGEDSERVE_MAX_LOGPROBS", "64")
    config = parse()
    assert config.max_logprobs == 64 and parse(*engine_argv(config)).max_logprobs == 64
    with pytest.raises(ConfigError, match="max_logprobs must be -1"):
        EngineConfig(device="cpu", max_logprobs=-2)


def test_kv_cache_dtype_from_the_flag_or_the_environment_and_handed_on(monkeypatch):
    from common.cli_args import engine_argv

    def parse(*argv: str) -> EngineConfig:
        return engine_config_from_args(add_engine_args(argparse.ArgumentParser()).parse_args(list(argv)))

    assert parse("--device", "cpu", "--dtype", "float32").resolved_kv_cache_dtype() == "float32"  # auto: the model's
    halved = parse("--device", "cpu", "--dtype", "float32", "--kv-cache-dtype", "bfloat16")
    assert halved.resolved_kv_cache_dtype() == "bfloat16"
    assert halved.block_size == 128  # blocks of the same bytes as a float32 cache's 64 tokens
    monkeypatch.setenv("PAGEDSERVE_KV_CACHE_DTYPE", "bfloat16")
    config = parse("--device", "cpu", "--dtype", "float32")
    assert config.kv_cache_dtype == "bfloat16" and parse(*engine_argv(config)).kv_cache_dtype == "bfloat16"


@pytest.mark.parametrize("name", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_the_8bit_kv_cache_dtypes_are_accepted_with_blocks_of_the_same_bytes(name, monkeypatch):
    from common.cli_args import engine_argv

    def parse(*argv: str) -> EngineConfig:
        return engine_config_from_args(add_engine_args(argparse.ArgumentParser()).parse_args(list(argv)))

    for dtype in ("float32", "bfloat16", "float16"):
        config = parse("--device", "cpu", "--dtype", dtype, "--kv-cache-dtype", name)
        assert config.resolved_kv_cache_dtype() == name
        assert config.block_size == 256  # a 16-bit cache's 128 tokens, in bytes
        assert parse(*engine_argv(config)).kv_cache_dtype == name
    assert EngineConfig(device="cuda", kv_cache_dtype=name).block_size == 16
    assert EngineConfig(device="cpu", kv_cache_dtype=name, block_size=64).block_size == 64
    monkeypatch.setenv("PAGEDSERVE_KV_CACHE_DTYPE", name)
    assert parse("--device", "cpu").kv_cache_dtype == name


def test_a_kv_cache_dtype_that_cannot_run_is_refused(capsys):
    for name in ("fp8_e4m3fn", "float8", "FP8", "int8", "float16"):
        with pytest.raises(ConfigError, match="kv_cache_dtype must be one of"):
            EngineConfig(device="cpu", kv_cache_dtype=name)
    with pytest.raises(ConfigError, match="needs a float32 or bfloat16 model"):
        EngineConfig(device="cpu", dtype="float16", kv_cache_dtype="bfloat16")
    with pytest.raises(SystemExit):
        add_engine_args(argparse.ArgumentParser()).parse_args(["--kv-cache-dtype", "int4"])
    assert "--kv-cache-dtype: invalid choice: 'int4'" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["worker", "scheduler", "frontend", "tokenizer"])
def test_settings_from_the_environment_are_plain_text_that_messages_can_carry(monkeypatch, command):
    """compose passes settings as PAGEDSERVE_* variables: a value read that way must encode in a
    protocol message like one from the command line (the worker sent its dtype in WorkerHello)."""
    import importlib

    from common.cli_args import EnvText
    from common.protocol import WorkerHello
    from common.transport import encode
    from pagedserve.cli import COMMANDS

    for name, value in {"DTYPE": "float32", "MODEL": "smollm2-135m-instruct", "LOG_LEVEL": "INFO",
                        "KV_CACHE_DTYPE": "auto", "DEVICE": "cpu"}.items():
        monkeypatch.setenv(f"PAGEDSERVE_{name}", value)
    module = importlib.import_module(COMMANDS[command][0])
    args = module.parse_args(module.build_parser(), [])
    from_env = {key: value for key, value in vars(args).items() if isinstance(value, EnvText)}
    assert from_env == {}
    if command == "worker":
        assert args.dtype == "float32"
        encode(WorkerHello(rank=0, model_name=args.model, num_blocks=1, block_size=16, max_model_len=8,
                           vocab_size=8, eos_token_ids=[0], dtype=args.dtype))


def test_quantization_from_the_flag_or_the_environment_and_handed_on(monkeypatch, capsys):
    from common.cli_args import engine_argv

    def parse(*argv: str) -> EngineConfig:
        return engine_config_from_args(add_engine_args(argparse.ArgumentParser()).parse_args(list(argv)))

    assert parse("--device", "cpu").quantization is None  # chosen by the model's format
    config = parse("--device", "cpu", "--quantization", "int8")
    assert config.quantization == "int8" and parse(*engine_argv(config)).quantization == "int8"
    monkeypatch.setenv("PAGEDSERVE_QUANTIZATION", "none")
    assert parse("--device", "cpu").quantization == "none"
    with pytest.raises(ConfigError, match="quantization must be one of"):
        EngineConfig(device="cpu", quantization="awq")
    with pytest.raises(SystemExit):
        add_engine_args(argparse.ArgumentParser()).parse_args(["--quantization", "fp4"])
    assert "--quantization/-q: invalid choice: 'fp4'" in capsys.readouterr().err
