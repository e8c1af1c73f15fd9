"""Fixtures the server tests share: `client`, the official OpenAI client on the module's `server`
(a `server_process.ServerProcess` fixture each module defines for its own model and flags)."""

from __future__ import annotations

import openai
import pytest


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as c:
        yield c
