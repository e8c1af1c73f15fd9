"""Shared pytest setup: `pyproject.toml` puts `tests/` on `sys.path` (`pythonpath`), so test
files import helpers with `from tiny_models import ...`."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: spawns processes (an engine core, a server, TP workers); "
                                       "deselect with -m 'not slow' for a quick run")
    config.addinivalue_line("markers", "soak: a short soak of a real server under mixed load (tests/soak.py); "
                                       "deselect with -m 'not soak'")
