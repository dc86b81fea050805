"""Fixtures for the tokenizer pool tests (helpers live in tokenizer_pool_helpers)."""
from __future__ import annotations

import pytest

from tokenizer_pool_helpers import PoolProcess, build_tiny_tokenizer, launch_pool


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> str:
    return str(build_tiny_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer")))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_tokenizer_dir):
    from common.tokenizer import load_tokenizer

    return load_tokenizer(tiny_tokenizer_dir)


@pytest.fixture
def start_pool(tmp_path):
    """Factory: start_pool(args) -> PoolProcess, stopped at teardown."""
    started: list[PoolProcess] = []

    def start(extra: list[str], **kwargs) -> PoolProcess:
        started.append(launch_pool(tmp_path, extra, **kwargs))
        return started[-1]

    yield start
    for pool in started:
        pool.stop()
