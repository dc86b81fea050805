"""`serve`'s check of every component's settings, before it starts any.

Each component reads its flags and, for what they leave out, PAGEDSERVE_*
variables it inherits from `serve`. A value it cannot use stops it with a
usage error (exit status 2); started by `serve`, that would only show as a
component exiting again after each restart. So `serve` parses each
component's command line with that component's own parser and checks
(`build_parser` and `parse_args` of its cli module), under the environment
the component will get, and stops at the first bad setting.
"""
from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from contextlib import contextmanager

from pagedserve.cli import COMMANDS
from common.errors import ConfigError
from pagedserve.process_supervisor import Component
from common.transport import CURVE_SECRET_ENV, curve_keys_from_env


@contextmanager
def _environment(extra: dict[str, str]) -> Iterator[None]:
    """os.environ as the component will see it (parsers read their env defaults when built)."""
    saved = dict(os.environ)
    os.environ.update(extra)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def check_component(component: Component) -> None:
    """Parse the component's settings as it will; ConfigError naming it and the bad setting."""
    module = importlib.import_module(COMMANDS[component.argv[0]][0])
    with _environment(component.env):
        parser = module.build_parser()
        parser.raise_errors = True
        try:
            module.parse_args(parser, component.argv[1:])
        except ConfigError as e:
            raise ConfigError(f"the {component.name} would not start: {e}") from None


def check_shared_settings() -> None:
    """Settings every component reads outside its parser."""
    try:
        curve_keys_from_env()
    except (OSError, ValueError) as e:
        raise ConfigError(f"{CURVE_SECRET_ENV} (or {CURVE_SECRET_ENV}_FILE): {e}") from None


def check_settings(components: list[Component]) -> None:
    """Raise ConfigError for the first setting some component could not start with."""
    check_shared_settings()
    for component in components:
        check_component(component)
