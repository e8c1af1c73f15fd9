"""Fixtures shared by the sampling tests in this folder: one tiny LLaVA and one engine over it."""

from __future__ import annotations

import pytest

from mmserve import LLM
from helpers.tiny_models import make_checkpoint


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("sampling"))


@pytest.fixture(scope="module")
def llm(path):
    return LLM(model=path)
