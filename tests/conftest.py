"""Shared pytest setup: `pyproject.toml` puts `tests/` on `sys.path` (`pythonpath`), so test
files import helpers with `from helpers.tiny_models import ...`.

Triton's interpreter is set up here, before any test module is collected: `triton` may be
imported by any of them (through torch or xgrammar), and a kernel decorated before
`TRITON_INTERPRET=1` is in the environment is compiled for a GPU (tests/helpers/triton_device.py)."""

from __future__ import annotations

import pytest

from helpers import triton_device  # noqa: F401  (first: sets TRITON_INTERPRET where there is no GPU)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: spawns processes (an engine core, a server, TP workers); "
                                       "deselect with -m 'not slow' for a quick run")
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (the GPU kit, `make test-gpu`); skipped where "
                                       "torch sees none")
    config.addinivalue_line("markers", "soak: a short soak of a real server under mixed load (tests/soak.py); "
                                       "deselect with -m 'not soak'")
    config.addinivalue_line("markers", "machine_wide: kills processes, checks /dev/shm or starts Ray, whose "
                                       "state is the machine's: under `-n` one worker runs every such file")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (`make test` runs two workers, `--dist loadgroup`) each file's tests run
    in one worker, as `--dist loadfile` would (a module's server or engine starts once), and every
    `machine_wide` file in the same one, one after another: a test that counts /dev/shm segments or
    Ray clusters must not see another worker's. Skip the `gpu` tests where CUDA is absent (at once:
    they build nothing)."""
    if config.pluginmanager.hasplugin("xdist"):
        for item in items:
            group = "machine_wide" if item.get_closest_marker("machine_wide") else item.nodeid.split("::")[0]
            item.add_marker(pytest.mark.xdist_group(group))
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (make test-gpu)")
        for item in gpu_items:
            item.add_marker(skip)
