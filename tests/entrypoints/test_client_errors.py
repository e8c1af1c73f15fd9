"""Client faults are 4xx, quietly; anything else is a 500 with one log line and an error id
(issue 40 item 5, issue 39 item 5). The HTTP layer over `test_openai_protocol`'s fake engine, and
one real uvicorn server for what only a socket shows (a body cut off, a request read too slowly)."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import pytest
import uvicorn
from fastapi.testclient import TestClient

from mmserve.entrypoints.openai.app import build_app
from mmserve.entrypoints.openai.read_timeout import read_timeout_protocol
from mmserve.errors import CLIENT, INTERNAL, ClientError, engine_error
from helpers.fake_engine import GOOD, MODEL, FakeEngine, post


class QuirkyEngine(FakeEngine):
    """The fake engine whose prompt building raises what the user text names."""

    async def build_prompt(self, messages, tools=None, settings=None, template=None):
        text = messages[-1]["content"][-1]["text"]
        if text == "internal":
            raise ValueError("a bug's message, not the client's fault")
        if text == "client":
            raise ClientError("the client's fault", param="messages")
        if text in ("engine", "refused"):
            raise engine_error("the engine failed on this request: boom", INTERNAL if text == "engine" else CLIENT)
        return await super().build_prompt(messages, tools, settings)


@pytest.fixture
def client() -> TestClient:
    return TestClient(build_app(QuirkyEngine(), [MODEL]), raise_server_exceptions=False)


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text}]}]


def test_a_plain_value_error_is_a_500_with_an_error_id_logged_once(client, caplog):
    with caplog.at_level(logging.INFO):
        r = post(client, {"model": MODEL, "messages": ask("internal")})
    assert r.status_code == 500
    error = r.json()["error"]
    assert error["type"] == "server_error" and "bug" not in error["message"]
    error_id = error["message"].split()[3]
    assert error_id.startswith("err-")
    lines = [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
    assert len(lines) == 1 and error_id in lines[0].getMessage()


def test_a_client_error_is_a_400_naming_its_param(client):
    r = post(client, {"model": MODEL, "messages": ask("client")})
    assert r.status_code == 400
    assert r.json()["error"] == {"message": "the client's fault", "type": "invalid_request_error",
                                 "code": "invalid_value", "param": "messages"}


def test_an_engine_error_output_is_a_500_naming_the_cause_or_a_400_for_a_refusal(client):
    r = post(client, {"model": MODEL, "messages": ask("engine")})
    assert r.status_code == 500 and "boom" in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "engine_error"
    assert post(client, {"model": MODEL, "messages": ask("refused")}).status_code == 400


def test_tool_choice_with_a_string_function_is_a_400(client):
    tools = [{"type": "function", "function": {"name": "a", "parameters": {"type": "object"}}}]
    r = post(client, {"model": MODEL, "messages": GOOD, "tools": tools, "tool_choice": {"function": "a"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


def test_a_schema_text_nested_330_deep_is_a_400(client, caplog):
    text = '{"type": "array", "items": ' * 330 + '{"type": "string"}' + "}" * 330
    body = {"model": MODEL, "messages": GOOD,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": text}}}
    with caplog.at_level(logging.INFO):
        r = post(client, body)
    assert r.status_code == 400 and "nested" in r.json()["error"]["message"]
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR]


@pytest.fixture
def live_server():
    """A real uvicorn server (the fake engine) with a 1 s request read timeout; yields its port."""
    config = uvicorn.Config(build_app(FakeEngine(), [MODEL]), host="127.0.0.1", port=0, log_level="info",
                            http=read_timeout_protocol(1.0), lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    yield server.servers[0].sockets[0].getsockname()[1]
    server.should_exit = True
    thread.join(5)


def test_a_body_cut_off_is_a_quiet_499(live_server, caplog):
    with caplog.at_level(logging.INFO):
        with socket.create_connection(("127.0.0.1", live_server)) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n" + b'{"model": ')
        time.sleep(0.5)
    errors = [rec for rec in caplog.records if rec.levelno >= logging.ERROR or rec.exc_info]
    assert not errors, [rec.getMessage() for rec in errors]
    assert any("closed the connection" in rec.getMessage() for rec in caplog.records)


def test_connections_that_send_no_whole_request_in_time_are_closed(live_server):
    socks = [socket.create_connection(("127.0.0.1", live_server)) for _ in range(50)]
    for sock in socks:
        sock.sendall(b"GET /hea")  # headers trickle in and never finish
        sock.settimeout(5)
    start = time.monotonic()
    for sock in socks:
        assert sock.recv(100) == b""  # closed by the server
        sock.close()
    assert time.monotonic() - start < 4
    body = json.dumps({"model": MODEL, "messages": GOOD}).encode()
    with socket.create_connection(("127.0.0.1", live_server)) as sock:  # a whole request is still served
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        sock.settimeout(5)
        assert sock.recv(100).startswith(b"HTTP/1.1 200")
