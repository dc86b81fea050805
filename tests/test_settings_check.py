"""`serve` checks every component's settings before starting any (no processes here).

Each component reads PAGEDSERVE_* variables it inherits from `serve`; a bad
one used to stop that component at every restart while `serve` never became
ready. The table below holds a bad value for every variable a component's
parser reads, and a test fails when a parser reads one the table lacks.
"""
from __future__ import annotations

import importlib
import re

import pytest

import common.cli_args
from pagedserve.cli import COMMANDS
from common.errors import ConfigError
from pagedserve.serve import build_parser, checked_settings

# variable -> (bad value, what the error must say)
BAD_VALUES: dict[str, tuple[str, ...]] = {
    # read by the frontend only: serve hands them on by inheritance
    "PAGEDSERVE_REQUEST_TIMEOUT": ("abc", "the frontend would not start", "--request-timeout"),
    "PAGEDSERVE_MAX_REQUEST_BODY_SIZE": ("big", "the frontend would not start", "--max-request-body-size"),
    # read by the scheduler only
    "PAGEDSERVE_MAX_WAITING_REQUESTS": ("-3", "the scheduler would not start", "--max-waiting-requests"),
    "PAGEDSERVE_WORKER_STEP_TIMEOUT": ("soon", "the scheduler would not start", "--worker-step-timeout"),
    # read by serve too (it hands them on): its own parser refuses them
    "PAGEDSERVE_PORT": ("99999", "--port"),
    "PAGEDSERVE_GRPC_PORT": ("-1", "--grpc-port"),
    "PAGEDSERVE_GENERATION_CONFIG": ("/no/such/dir", "--generation-config"),
    "PAGEDSERVE_TOOL_CALL_PARSER": ("bogus", "--tool-call-parser"),
    "PAGEDSERVE_TOKENIZER_POOL_SIZE": ("two", "--tokenizer-pool-size"),
    "PAGEDSERVE_DTYPE": ("float8", "--dtype"),
    "PAGEDSERVE_KV_CACHE_DTYPE": ("fp4", "--kv-cache-dtype"),
    "PAGEDSERVE_QUANTIZATION": ("awq", "--quantization"),
    "PAGEDSERVE_DEVICE": ("tpu", "--device"),
    "PAGEDSERVE_ATTENTION_BACKEND": ("flash", "--attention-backend"),
    "PAGEDSERVE_KV_CACHE_MEMORY": ("lots", "--kv-cache-memory"),
    "PAGEDSERVE_MAX_NUM_SEQS": ("many", "--max-num-seqs"),
    "PAGEDSERVE_MAX_LORAS": ("0", "--max-loras"),
    "PAGEDSERVE_MAX_LORA_RANK": ("big", "--max-lora-rank"),
    "PAGEDSERVE_MAX_CPU_LORAS": ("-2", "--max-cpu-loras"),
    "PAGEDSERVE_ALLOWED_ORIGINS": ("*", "--allowed-origins"),
    "PAGEDSERVE_ALLOWED_METHODS": ("GET", "--allowed-methods"),
    "PAGEDSERVE_ALLOWED_HEADERS": ("x", "--allowed-headers"),
    "PAGEDSERVE_MAX_LOG_LEN": ("-1", "--max-log-len"),
    "PAGEDSERVE_SCHEDULER_RESTART_TIMEOUT": ("-1", "--scheduler-restart-timeout"),
    "PAGEDSERVE_LOG_LEVEL": ("loud", "--log-level"),
    "PAGEDSERVE_TENSOR_PARALLEL_SIZE": ("0", "--tensor-parallel-size"),
    "PAGEDSERVE_PIPELINE_PARALLEL_SIZE": ("two", "--pipeline-parallel-size"),
    "PAGEDSERVE_DATA_PARALLEL_SIZE": ("-1", "--data-parallel-size"),
    "PAGEDSERVE_RUNNER": ("embed", "--runner"),
    # read by serve too, checked after parsing: the message names the setting, not the variable
    "PAGEDSERVE_BLOCK_SIZE": ("12", "block_size must be a positive power of two"),
    "PAGEDSERVE_MAX_LOGPROBS": ("-5", "max_logprobs must be -1"),
    "PAGEDSERVE_DISTRIBUTED_INIT_METHOD": ("udp://x", "distributed_init_method must be"),
    "PAGEDSERVE_GGUF_FILE": ("model.bin", "gguf_file must name a .gguf file"),
    "PAGEDSERVE_SPECULATIVE_CONFIG": ('{"method": "ngram"}', "num_speculative_tokens is required"),
    "PAGEDSERVE_POOLER_CONFIG": ('{"pooling_type": "MAX"}', "pooling_type must be one of"),
    "PAGEDSERVE_CHAT_TEMPLATE": ("no/such/template.jinja", "the tokenizer would not start", "no such file"),
    # The scheduler reads them too (its control service), and is checked before the frontend.
    "PAGEDSERVE_SSL_KEYFILE": ("/no/such/key.pem", "the scheduler would not start", "--ssl-keyfile and"),
    "PAGEDSERVE_SSL_CERTFILE": ("/no/such/cert.pem", "the scheduler would not start", "--ssl-keyfile and"),
}
# Any text is a valid value of these (or one serve always overrides on the command line).
ANY_TEXT = {"PAGEDSERVE_MODEL", "PAGEDSERVE_HOST", "PAGEDSERVE_SERVED_MODEL_NAME", "PAGEDSERVE_CACHE_DIR",
            "PAGEDSERVE_API_KEY", "PAGEDSERVE_RESPONSE_ROLE", "PAGEDSERVE_TOKENIZER_JOIN", "PAGEDSERVE_REVISION",
            "PAGEDSERVE_TOKENIZER"}
# Read outside any parser: serve checks them itself.
SHARED_BAD_VALUES = {"PAGEDSERVE_CURVE_SECRET_KEY": "not-a-key"}


def check_serve(argv: list[str] | None = None) -> None:
    parser = build_parser()  # after the environment is set: defaults are read when the parser is built
    parser.raise_errors = True
    checked_settings(parser, argv or [])


def test_the_defaults_pass():
    check_serve()


@pytest.mark.parametrize("variable", sorted(BAD_VALUES))
def test_serve_refuses_a_bad_value_any_component_would_read(variable, monkeypatch):
    value, *fragments = BAD_VALUES[variable]
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError) as error:
        check_serve()
    message = str(error.value)
    if any(re.fullmatch(r"--[a-z-]+", fragment) for fragment in fragments):  # a flag's value: the variable too
        fragments.append(f"(from {variable} in the environment)")
    for fragment in fragments:
        assert fragment in message, message


@pytest.mark.parametrize("variable", sorted(SHARED_BAD_VALUES))
def test_serve_refuses_a_bad_shared_setting(variable, monkeypatch):
    monkeypatch.setenv(variable, SHARED_BAD_VALUES[variable])
    with pytest.raises(ConfigError, match=variable):
        check_serve()


def test_a_switch_that_needs_another_setting_names_the_component(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_ENABLE_AUTO_TOOL_CHOICE", "1")
    with pytest.raises(ConfigError, match="the frontend would not start: --enable-auto-tool-choice needs"):
        check_serve()
    monkeypatch.setenv("PAGEDSERVE_TOOL_CALL_PARSER", "hermes")
    check_serve()


def test_a_flag_on_serve_s_command_line_wins_over_the_variable(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_PORT", "99999")
    monkeypatch.setenv("PAGEDSERVE_GENERATION_CONFIG", "/no/such/dir")
    check_serve(["--port", "8123", "--generation-config", "vllm"])


def test_the_table_covers_every_variable_a_component_parser_reads(monkeypatch):
    read: set[str] = set()
    original = common.cli_args._from_env

    def recording(name: str):
        read.add(f"PAGEDSERVE_{name}")
        return original(name)

    monkeypatch.setattr(common.cli_args, "_from_env", recording)
    for command in ("serve", "frontend", "tokenizer", "scheduler", "worker"):
        importlib.import_module(COMMANDS[command][0]).build_parser()
    assert "PAGEDSERVE_REQUEST_TIMEOUT" in read
    missing = read - set(BAD_VALUES) - ANY_TEXT
    assert not missing, f"add a bad value for {sorted(missing)} to BAD_VALUES (or to ANY_TEXT)"


def frontend_argv(argv: list[str]) -> list[str]:
    from pagedserve.serve import component_commands

    components = component_commands(build_parser().parse_args(argv), "/run")
    return next(c for c in components if c.name == "frontend").argv


def flag_value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_serve_hands_on_the_variables_rather_than_its_own_defaults(monkeypatch):
    """A flag, else the PAGEDSERVE_* variable, else the default: serve's own
    `--generation-config auto` used to mask PAGEDSERVE_GENERATION_CONFIG."""
    monkeypatch.setenv("PAGEDSERVE_GENERATION_CONFIG", "vllm")
    monkeypatch.setenv("PAGEDSERVE_PORT", "8123")
    monkeypatch.setenv("PAGEDSERVE_SERVED_MODEL_NAME", "alpha,beta")
    argv = frontend_argv([])
    assert flag_value(argv, "--generation-config") == "vllm"
    assert flag_value(argv, "--port") == "8123"
    assert argv[argv.index("--served-model-name") + 1:][:2] == ["alpha", "beta"]
    argv = frontend_argv(["--generation-config", "auto", "--port", "9000", "--served-model-name", "gamma"])
    assert (flag_value(argv, "--generation-config"), flag_value(argv, "--port")) == ("auto", "9000")
    assert flag_value(argv, "--served-model-name") == "gamma"
