"""The GPU kit runs in one process: after each test every `LLM` it left alive (a failure's
traceback holds its locals) is shut down, so the next test's engine is sized on the whole GPU."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from helpers.gpu_cases import release_llms


@pytest.fixture(autouse=True)
def _release_engines() -> Iterator[None]:
    yield
    release_llms()
