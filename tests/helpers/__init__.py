"""Test helpers shared by the test folders (import as `from helpers.tiny_models import ...`).

Tiny checkpoints, media and prompts (`tiny_models`, `tiny_videos`, `mm_prompts`), the engine and
server runners (`core_client_runs`, `parity_runs`, `server_process`, `fake_engine`,
`shm_items_for_tests`), the scheduler simulator (`scheduler_sim`), the Hugging Face references
(`hf_reference`, `hf_logits`), the GPU cases and Triton's set-up (`gpu_cases`, `triton_device`).

Their names before the move (`tiny_models`, ...) still import, as the same modules, once this
package is imported (the root conftest does): for tests written before it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType

OLD_NAMES = frozenset({"core_client_runs", "fake_engine", "gpu_cases", "hf_logits", "hf_reference", "mm_prompts",
                       "parity_runs", "scheduler_sim", "server_process", "shm_items_for_tests", "tiny_models",
                       "tiny_videos", "triton_device"})


class _Alias(importlib.abc.Loader):
    """Loads an old name as the module `helpers.<name>` itself (one module, two names)."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(f"{__name__}.{spec.name}")
        self.spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self.spec  # already run as helpers.<name>; it keeps its own spec


class _OldNames(importlib.abc.MetaPathFinder):
    """Finds a helper by its name before the move."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.util.spec_from_loader(name, _Alias()) if name in OLD_NAMES else None


if not any(isinstance(finder, _OldNames) for finder in sys.meta_path):
    sys.meta_path.append(_OldNames())
