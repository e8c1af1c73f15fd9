"""Shared pytest setup: `pyproject.toml` puts `tests/` on `sys.path` (`pythonpath`), so test
files import helpers with `from tiny_models import ...`."""
