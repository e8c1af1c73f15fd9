"""Fetching images over http(s), for hosts the operator allowed (`--allowed-media-domains`).

Contract of `fetch_http(url, limits)`:
- the host must be in `limits.allowed_media_domains`, at every redirect too;
- the host name is resolved once per connection and every address it resolves to is checked:
  loopback, link-local, private, unique-local, multicast, reserved and unspecified addresses are
  refused unless the operator allows them (`--allow-private-media-addresses`); the connection
  then goes to the checked address itself (the name is not resolved again, so a DNS answer that
  changes between the check and the connect cannot redirect it), with the host name kept for the
  Host header and TLS (SNI and certificate);
- one deadline, `limits.fetch_timeout_s`, bounds the whole fetch (connect, headers and body
  together, redirects included), not each socket call: when it passes the connection is shut
  down under whatever read is waiting (a name lookup itself cannot be interrupted);
- the body is read up to `limits.max_bytes` (+1, to detect more);
- no proxy is used (the environment's proxy settings are ignored), since the check is on the
  address the connection goes to.
Every refusal is a `MediaError` naming the flag that changes it.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import ipaddress
import socket
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from mmserve.multimodal.media import FLAG_DOMAINS, MediaError, MediaLimits, check_bytes

FLAG_PRIVATE = "--allow-private-media-addresses"


def check_http_url(url: str, limits: MediaLimits) -> None:
    """Refuse an http(s) URL whose host is not in `limits.allowed_media_domains`."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme.lower() not in ("http", "https"):
        raise MediaError(f"unsupported image URL scheme {parts.scheme!r} in {url!r}: only http(s) may be fetched")
    host = (parts.hostname or "").lower()
    if not limits.allowed_media_domains:
        raise MediaError(f"fetching images over http(s) is disabled; allow host {host!r} with {FLAG_DOMAINS}")
    if host not in limits.allowed_media_domains:
        raise MediaError(f"image host {host!r} is not allowed; allowed hosts: "
                         f"{', '.join(limits.allowed_media_domains)} (set with {FLAG_DOMAINS})")


def checked_address(host: str, port: int, limits: MediaLimits) -> str:
    """The address to connect to for `host`: the first it resolves to, once every one of them
    passed the check (an attacker's name may resolve to one public and one private address)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise MediaError(f"could not resolve image host {host!r}: {exc}") from exc
    addresses = [str(info[4][0]) for info in infos]
    if not limits.allow_private_addresses:
        for address in addresses:
            if not _is_public(ipaddress.ip_address(address.split("%")[0])):
                raise MediaError(f"image host {host!r} resolves to {address}, a loopback, link-local or private "
                                 f"address; fetching from those is refused (allow with {FLAG_PRIVATE})")
    return addresses[0]


def _is_public(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not (ip.is_multicast or ip.is_reserved or ip.is_unspecified)


class _Deadline:
    """One fetch's deadline. `left()` is the time that remains (a MediaError once none does); the
    sockets `watch`ed are shut down when it passes, so no read outlives it, not even one of a
    server trickling its headers or body a byte at a time under any per-call timeout."""

    def __init__(self, seconds: float, url: str) -> None:
        self.end, self.url, self.expired = time.monotonic() + seconds, url, False
        self._sockets: list[socket.socket] = []
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def left(self) -> float:
        left = self.end - time.monotonic()
        if left <= 0 or self.expired:
            raise self.error()
        return left

    def error(self) -> MediaError:
        return MediaError(f"fetching image {self.url!r} took longer than its deadline")

    def watch(self, sock: socket.socket) -> socket.socket:
        self._sockets.append(sock)
        if self.expired:
            self._expire()
        return sock

    def cancel(self) -> None:
        self._timer.cancel()

    def _expire(self) -> None:
        self.expired = True
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


class _PinnedHTTPConnection(http.client.HTTPConnection):
    """Connects to the checked address of `self.host`, within the fetch's deadline."""

    def __init__(self, host: str, *, limits: MediaLimits, deadline: _Deadline, **kw: Any) -> None:
        super().__init__(host, **kw)
        self.limits, self.deadline = limits, deadline

    def connect(self) -> None:
        address = checked_address(self.host, self.port, self.limits)
        self.sock = self.deadline.watch(socket.create_connection((address, self.port), timeout=self.deadline.left()))


class _PinnedHTTPSConnection(http.client.HTTPSConnection):
    """The same over TLS: the certificate is checked against the host name, not the address."""

    def __init__(self, host: str, *, limits: MediaLimits, deadline: _Deadline, **kw: Any) -> None:
        super().__init__(host, **kw)
        self.limits, self.deadline = limits, deadline

    def connect(self) -> None:
        address = checked_address(self.host, self.port, self.limits)
        sock = self.deadline.watch(socket.create_connection((address, self.port), timeout=self.deadline.left()))
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)  # type: ignore[attr-defined]


class _PinnedHandler(urllib.request.HTTPHandler, urllib.request.HTTPSHandler):
    """urllib's http and https handlers over the pinned connections above."""

    def __init__(self, limits: MediaLimits, deadline: _Deadline) -> None:
        urllib.request.HTTPHandler.__init__(self)
        urllib.request.HTTPSHandler.__init__(self, context=ssl.create_default_context())
        self.limits, self.deadline = limits, deadline

    def http_open(self, req: urllib.request.Request) -> Any:
        return self.do_open(functools.partial(_PinnedHTTPConnection, limits=self.limits, deadline=self.deadline), req)

    def https_open(self, req: urllib.request.Request) -> Any:
        return self.do_open(functools.partial(_PinnedHTTPSConnection, limits=self.limits, deadline=self.deadline), req,
                            context=self._context)  # type: ignore[attr-defined]


class RedirectGuard(urllib.request.HTTPRedirectHandler):
    """Follows an http(s) redirect only when its target passes `check_http_url`."""

    def __init__(self, limits: MediaLimits) -> None:
        super().__init__()
        self.limits = limits

    def redirect_request(self, req: urllib.request.Request, fp: Any, code: int, msg: str, headers: Any,
                         newurl: str) -> urllib.request.Request | None:
        check_http_url(urllib.parse.urljoin(req.full_url, newurl), self.limits)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def fetch_http(url: str, limits: MediaLimits) -> bytes:
    """The body `url` names, within the contract above."""
    check_http_url(url, limits)
    deadline = _Deadline(limits.fetch_timeout_s, url)
    # no proxy (the environment's proxy settings are ignored): the check is on the address connected to
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), _PinnedHandler(limits, deadline),
                                         RedirectGuard(limits))
    try:
        with opener.open(url, timeout=deadline.left()) as response:
            length = response.headers.get("Content-Length")
            if length is not None and length.isdigit():
                check_bytes(int(length), limits)
            data = response.read(limits.max_bytes + 1)
    except urllib.error.HTTPError as exc:
        raise MediaError(f"fetching image {url!r} failed with HTTP status {exc.code}") from exc
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        if deadline.expired:
            raise deadline.error() from exc
        raise MediaError(f"could not fetch image {url!r}: {getattr(exc, 'reason', exc)}") from exc
    finally:
        deadline.cancel()
    if deadline.expired:  # the shutdown may end a read early rather than fail it
        raise deadline.error()
    check_bytes(len(data), limits)
    return data
