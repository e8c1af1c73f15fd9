"""Media hardening (issue 14, case 7): a local path is opened without following any component
swapped for a symlink after the check; an http(s) fetch connects to the address it checked,
refuses loopback / link-local / private addresses unless the operator allows them, and is bounded
by one total deadline rather than a timeout per socket call."""

from __future__ import annotations

import io
import os
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

import pytest
from PIL import Image

from mmserve.config import EngineConfig
from mmserve.multimodal import http_fetch, media
from mmserve.multimodal.media import MediaError, MediaLimits, load_image, read_media_bytes

PNG = io.BytesIO()
Image.new("RGB", (8, 6), (255, 0, 0)).save(PNG, format="PNG")


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = PNG.getvalue()
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        if self.path == "/trickle.png":  # one byte every 50 ms: each read is quick, the whole is not
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            try:
                for byte in body:
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                    time.sleep(0.05)
            except OSError:
                pass  # the client gave up, as it should
            return
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()


def resolving_to(monkeypatch: pytest.MonkeyPatch, *addresses: str) -> list[tuple]:
    """Make every name resolve to `addresses`; the list of connects made, (address, port) each."""
    def getaddrinfo(host, port, *args, **kwargs):
        family = {4: socket.AF_INET, 6: socket.AF_INET6}
        return [(family[6 if ":" in a else 4], socket.SOCK_STREAM, 6, "", (a, port)) for a in addresses]

    connects: list[tuple] = []
    real_connect = socket.create_connection

    def create_connection(address, *args, **kwargs):
        connects.append(address)
        return real_connect(address, *args, **kwargs)

    monkeypatch.setattr(http_fetch.socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(http_fetch.socket, "create_connection", create_connection)
    return connects


def test_loopback_is_refused_even_for_an_allowed_host(port: int) -> None:
    limits = MediaLimits(allowed_media_domains=("localhost", "127.0.0.1"))
    for url in (f"http://localhost:{port}/a.png", f"http://127.0.0.1:{port}/a.png"):
        with pytest.raises(MediaError, match="--allow-private-media-addresses"):
            read_media_bytes(url, limits)
    allowed = MediaLimits(allowed_media_domains=("localhost",), allow_private_addresses=True)
    assert load_image(f"http://localhost:{port}/a.png", allowed).size == (8, 6)


@pytest.mark.parametrize("address", ["10.1.2.3", "192.168.0.7", "169.254.169.254", "fe80::1", "fd00::5",
                                     "::ffff:127.0.0.1", "0.0.0.0", "224.0.0.1"])
def test_private_link_local_and_odd_addresses_are_refused(monkeypatch, address: str) -> None:
    connects = resolving_to(monkeypatch, address)
    with pytest.raises(MediaError, match="private address"):
        read_media_bytes("http://images.test/a.png", MediaLimits(allowed_media_domains=("images.test",)))
    assert connects == []


def test_one_private_address_among_public_ones_is_refused(monkeypatch) -> None:
    connects = resolving_to(monkeypatch, "93.184.216.34", "127.0.0.1")
    with pytest.raises(MediaError, match="127.0.0.1"):
        read_media_bytes("http://images.test/a.png", MediaLimits(allowed_media_domains=("images.test",)))
    assert connects == []


def test_the_connection_goes_to_the_checked_address(monkeypatch, port: int) -> None:
    """`images.test` exists only in the patched resolver: the fetch works only if it connects to
    the address that was checked instead of resolving the name again."""
    connects = resolving_to(monkeypatch, "127.0.0.1")
    limits = MediaLimits(allowed_media_domains=("images.test",), allow_private_addresses=True)
    assert read_media_bytes(f"http://images.test:{port}/a.png", limits) == PNG.getvalue()
    assert connects == [("127.0.0.1", port)]


def test_the_fetch_timeout_bounds_the_whole_fetch(port: int) -> None:
    limits = MediaLimits(allowed_media_domains=("127.0.0.1",), allow_private_addresses=True, fetch_timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(MediaError, match="deadline"):
        read_media_bytes(f"http://127.0.0.1:{port}/trickle.png", limits)
    assert time.monotonic() - start < 2.5  # the trickle takes ~5 s; each read alone is quick


def test_the_operator_flag_reaches_the_media_limits() -> None:
    assert not EngineConfig.from_kwargs().multimodal.media_limits().allow_private_addresses
    config = EngineConfig.from_kwargs(allow_private_media_addresses=True)
    assert config.multimodal.media_limits().allow_private_addresses


def test_a_directory_swapped_for_a_symlink_is_not_followed(tmp_path: Path, monkeypatch) -> None:
    """The check resolves the path; an attacker then swaps a directory on it for a symlink to a
    directory outside. Each component is opened with O_NOFOLLOW, so the open fails."""
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    (allowed / "sub").mkdir(parents=True)
    outside.mkdir()
    Image.new("RGB", (8, 6)).save(allowed / "sub" / "a.png")
    Image.new("RGB", (9, 9)).save(outside / "a.png")
    real_realpath = os.path.realpath

    def swap_after_check(path: str) -> str:
        resolved = real_realpath(path)
        if resolved.endswith("a.png") and not os.path.islink(allowed / "sub"):
            os.rename(allowed / "sub", tmp_path / "moved")
            os.symlink(outside, allowed / "sub")
        return resolved

    limits = MediaLimits(allowed_local_media_path=str(allowed))
    assert load_image(str(allowed / "sub" / "a.png"), limits).size == (8, 6)  # untouched: read
    monkeypatch.setattr(media.os.path, "realpath", swap_after_check)
    with pytest.raises(MediaError, match="could not read image file"):
        load_image(str(allowed / "sub" / "a.png"), limits)
