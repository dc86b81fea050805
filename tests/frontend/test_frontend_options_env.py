"""PAGEDSERVE_* settings of the frontend as compose passes them: a switch set to
"False"/"no"/"off" is off (any case), and an empty value (compose's
`${VAR:-}` for "not set") takes the flag's default instead of failing."""
from __future__ import annotations

import pytest

from frontend.frontend_cli import build_parser


@pytest.mark.parametrize("value", ["False", "FALSE", "no", "off", "0", "", " false "])
def test_a_switch_set_to_false_is_off(value, monkeypatch):
    for name in ("ALLOW_CREDENTIALS", "ENABLE_LOG_REQUESTS", "DISABLE_UVICORN_ACCESS_LOG", "ENABLE_AUTO_TOOL_CHOICE"):
        monkeypatch.setenv(f"PAGEDSERVE_{name}", value)
    args = build_parser().parse_args([])
    assert not (args.allow_credentials or args.enable_log_requests or args.disable_uvicorn_access_log
                or args.enable_auto_tool_choice)


@pytest.mark.parametrize("value", ["1", "true", "True", "yes", "on"])
def test_a_switch_set_to_true_is_on(value, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_ALLOW_CREDENTIALS", value)
    assert build_parser().parse_args([]).allow_credentials


def test_empty_settings_take_the_defaults(monkeypatch):
    for name in ("ALLOWED_ORIGINS", "ALLOWED_METHODS", "ALLOWED_HEADERS", "RESPONSE_ROLE", "MAX_LOG_LEN",
                 "SSL_KEYFILE", "SSL_CERTFILE"):
        monkeypatch.setenv(f"PAGEDSERVE_{name}", "")
    args = build_parser().parse_args([])
    assert args.allowed_origins == args.allowed_methods == args.allowed_headers == ["*"]
    assert (args.response_role, args.max_log_len, args.ssl_keyfile, args.ssl_certfile) == ("assistant", None, None,
                                                                                              None)


def test_an_empty_chat_template_setting_is_the_models(monkeypatch):
    from tokenizer_pool.tokenizer_pool_cli import build_parser as tokenizer_parser

    monkeypatch.setenv("PAGEDSERVE_CHAT_TEMPLATE", "")
    assert tokenizer_parser().parse_args([]).chat_template is None
