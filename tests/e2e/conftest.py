"""Fixtures for end-to-end tests against a real `pagedserve serve`."""
from __future__ import annotations

import pytest

from serve_helpers import MODEL, running_server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("serve"), []) as srv:
        yield srv


@pytest.fixture(scope="module")
def offline_llm():
    from pagedserve.offline.llm import LLM
    return LLM(model=MODEL, dtype="float32", kv_cache_memory=1 << 30)
