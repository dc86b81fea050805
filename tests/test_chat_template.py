"""--chat-template, as vLLM reads it: a Jinja file or the template itself,
checked at startup (the pool rendering with it: tests/tokenizer_pool)."""
from __future__ import annotations

import pytest

from common.errors import ConfigError
from common.tokenizer import load_chat_template
from test_cli_errors import assert_clear_error, run

TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<bot>{% endif %}"


def test_a_file_or_the_text_itself(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE + "\n", encoding="utf-8")
    assert load_chat_template(str(path)) == TEMPLATE + "\n"
    assert load_chat_template(TEMPLATE) == TEMPLATE
    assert load_chat_template(None) is None


@pytest.mark.parametrize("value, message", [
    ("templates/missing.jinja", "looks like a path, but there is no such file"),
    ("{% for m in messages %}{{ m.content }}", "is not valid Jinja"),
    ("{{ messages[0].content", "is not valid Jinja"),
])
def test_a_missing_file_or_a_broken_template_is_a_clear_error(value, message):
    with pytest.raises(ConfigError, match=message):
        load_chat_template(value)


def test_an_empty_file_is_an_error(tmp_path):
    (tmp_path / "empty.jinja").write_text("  \n")
    with pytest.raises(ConfigError, match="is empty"):
        load_chat_template(str(tmp_path / "empty.jinja"))


@pytest.mark.parametrize("command", ["serve", "tokenizer"])
def test_serve_and_the_tokenizer_pool_refuse_a_bad_template_at_startup(command):
    code, output = run([command, "--chat-template", "no/such/template.jinja"])
    assert_clear_error(code, output, "no/such/template.jinja", "no such file")


@pytest.mark.parametrize("command", ["serve", "tokenizer"])
def test_a_bad_template_in_the_environment_stops_startup(command, tmp_path):
    """serve's tokenizer pool inherits PAGEDSERVE_CHAT_TEMPLATE: serve checks it
    too, or the pool exits and is restarted forever. A directory says so."""
    code, output = run([command], env={"PAGEDSERVE_CHAT_TEMPLATE": str(tmp_path)}, timeout=30)
    assert_clear_error(code, output, str(tmp_path), "is a directory")


def test_serve_hands_the_template_from_the_environment_on(tmp_path, monkeypatch):
    from pagedserve.serve import build_parser, component_commands

    (tmp_path / "t.jinja").write_text(TEMPLATE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PAGEDSERVE_CHAT_TEMPLATE", "t.jinja")
    tokenizer = next(c for c in component_commands(build_parser().parse_args([]), str(tmp_path))
                     if c.name == "tokenizer")
    assert tokenizer.argv[tokenizer.argv.index("--chat-template") + 1] == str(tmp_path / "t.jinja")
