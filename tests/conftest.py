"""Shared pytest setup: `pyproject.toml` puts `tests/` on `sys.path` (`pythonpath`), so test
files import helpers with `from helpers.tiny_models import ...`.

Triton's interpreter is set up here, before any test module is collected: `triton` may be
imported by any of them (through torch or xgrammar), and a kernel decorated before
`TRITON_INTERPRET=1` is in the environment is compiled for a GPU (tests/helpers/triton_device.py)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from helpers import triton_device  # noqa: F401  (first: sets TRITON_INTERPRET where there is no GPU)

ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: spawns processes (an engine core, a server, TP workers); "
                                       "deselect with -m 'not slow' for a quick run")
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (the GPU kit, `make test-gpu`); skipped where "
                                       "torch sees none")
    config.addinivalue_line("markers", "soak: a short soak of a real server under mixed load (tests/soak.py); "
                                       "deselect with -m 'not soak'")
    config.addinivalue_line("markers", "machine_wide: kills processes, checks /dev/shm or starts Ray, whose "
                                       "state is the machine's: under `-n` one worker runs every such file")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Under pytest-xdist (`make test` runs two workers) each file's tests run in one worker, as
    `--dist loadfile` would (a module's server or engine starts once), and every `machine_wide`
    file in the same one, one after another: a test that counts /dev/shm segments or Ray clusters
    must not see another worker's. (`--dist loadgroup` with `xdist_group` marks did this until
    pytest 9, whose node ids xdist 3.8 can no longer suffix with the group: every test was then
    scheduled alone, a file's servers started in both workers.)"""
    from xdist.scheduler import LoadScopeScheduling

    class FileScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "machine_wide" if _machine_wide(path) else path

    return FileScheduling(config, log)


@functools.cache
def _machine_wide(path: str) -> bool:
    """Whether the test file at `path` (a node id's, from the root) marks itself `machine_wide`."""
    try:
        return "pytest.mark.machine_wide" in (ROOT / path).read_text()
    except OSError:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the `gpu` tests where CUDA is absent (at once: they build nothing)."""
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (make test-gpu)")
        for item in gpu_items:
            item.add_marker(skip)
