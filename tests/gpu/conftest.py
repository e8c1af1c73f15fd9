"""The GPU kit runs in one process: after each test every `LLM` it left alive (a failure's
traceback holds its locals) is shut down, so the next test's engine is sized on the whole GPU."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from helpers.gpu_cases import release_llms


@pytest.fixture(autouse=True)
def _release_engines() -> Iterator[None]:
    yield
    release_llms()


@pytest.fixture
def exact_float32() -> Iterator[None]:
    """No TF32 anywhere (cuDNN convolutions use it by default): float32 means float32 here."""
    before = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = before
