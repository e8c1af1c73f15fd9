"""AsyncLLM's start makes the P0 processor while the engine cores start: a processor that cannot be
made (the checkpoint lacks its image processor config) fails the start after the engine core is
up, leaving no process, shared-memory segment or socket directory behind."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import tempfile

import pytest

from mmserve.config import EngineConfig
from mmserve.frontend.async_llm import AsyncLLM
from helpers.tiny_models import make_checkpoint
from helpers.shm_listing import shm_listing

pytestmark = [pytest.mark.slow, pytest.mark.machine_wide]  # spawns processes (deselect with -m 'not slow')



def ipc_dirs() -> set[str]:
    return {name for name in os.listdir(tempfile.gettempdir()) if name.startswith(f"mmserve-{os.getpid()}-")}


@pytest.mark.parametrize("cache_type", ["lru", "shm"])
def test_a_processor_that_cannot_be_made_fails_the_start_and_leaves_nothing(tmp_path, cache_type):
    broken = tmp_path / "no-processor"
    shutil.copytree(make_checkpoint(tmp_path), broken)
    (broken / "processor_config.json").unlink()  # the image processor's settings
    shm, dirs, children = shm_listing(), ipc_dirs(), set(multiprocessing.active_children())
    with pytest.raises(OSError, match="image processor"):
        AsyncLLM(EngineConfig.from_kwargs(model=str(broken), mm_cache_type=cache_type, mm_shm_cache_gb=0.01))
    assert set(multiprocessing.active_children()) <= children  # the engine core had started: it was stopped
    assert shm_listing() == shm and ipc_dirs() == dirs

