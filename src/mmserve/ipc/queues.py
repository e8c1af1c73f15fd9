"""Typed one-way queues over ZMQ PUSH/PULL with the codec injected.

`QueueSender[T]` encodes with a `MsgpackEncoder` and sends multipart frames without copying
big ones; `QueueReceiver[T]` receives without copying and decodes with a `MsgpackDecoder`.
Addresses are `ipc://` paths inside a per-instance directory from `private_dirs.make_ipc_dir()`; the side
that binds (P0) owns that directory and removes it. An engine core on another machine (Ray) is
reached over `tcp_address(host)` instead: the port is picked at bind time, and the queue's
`address` is then the bound one, to give the peer.

Invariants:
- high-water marks are unlimited: a send never blocks while a peer is connected; it blocks
  (up to its timeout) only while no peer is connected, e.g. before P1 connects or after it died.
- a tensor passed to `send` must not change until the message has left (zmq holds a view).
- a receiver is used by one thread at a time; `recv_async` consumes a message only after its
  wait completes, so cancelling it loses nothing.
"""

from __future__ import annotations

import math
import os
import time
from typing import Generic, TypeVar

import zmq
import zmq.asyncio

from mmserve.ipc.serial import MsgpackDecoder, MsgpackEncoder

T = TypeVar("T")

def ipc_address(ipc_dir: str, name: str) -> str:
    """`ipc://<ipc_dir>/<name>.sock`."""
    return f"ipc://{os.path.join(ipc_dir, name)}.sock"


def tcp_address(host: str) -> str:
    """`tcp://<host>:*`: bound on a free port of `host` (an IPv4 address or a name)."""
    return f"tcp://{host}:*"


def ipc_path(address: str) -> str:
    """The socket file of an `ipc://` address."""
    return address.removeprefix("ipc://")


def _make_socket(ctx: zmq.Context, kind: int, address: str, bind: bool, linger_ms: int) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, linger_ms)
    if bind:
        sock.bind(address)  # a `tcp://host:*` address gets a free port: see `_bound_address`
    else:
        sock.connect(address)
    return sock


def _bound_address(sock: zmq.Socket, address: str) -> str:
    """The address a peer connects to: `address` with the port a `tcp://host:*` bind picked."""
    return sock.getsockopt_string(zmq.LAST_ENDPOINT) if address.endswith(":*") else address


def _remaining_ms(deadline: float | None) -> int | None:
    """Milliseconds left until `deadline` (monotonic s), rounded up; None waits forever."""
    if deadline is None:
        return None
    return max(0, math.ceil((deadline - time.monotonic()) * 1000))


class QueueSender(Generic[T]):
    """The PUSH end of a queue of `T`s."""

    def __init__(self, ctx: zmq.Context, address: str, encoder: MsgpackEncoder, *, bind: bool,
                 linger_ms: int = 0) -> None:
        self._encoder = encoder
        self._socket = _make_socket(ctx, zmq.PUSH, address, bind, linger_ms)
        self.address = _bound_address(self._socket, address)

    def send(self, obj: T, timeout_s: float | None = None) -> None:
        """Queue `obj`; TimeoutError if no peer takes it within `timeout_s` (None: wait forever)."""
        frames = self._encoder.encode(obj)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:
                self._socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                pass
            remaining_ms = _remaining_ms(deadline)
            if remaining_ms == 0:
                raise TimeoutError(f"no peer took the message on {self.address} within {timeout_s} s")
            self._socket.poll(remaining_ms, zmq.POLLOUT)

    def close(self) -> None:
        self._socket.close()


class QueueReceiver(Generic[T]):
    """The PULL end of a queue of `T`s."""

    def __init__(self, ctx: zmq.Context, address: str, decoder: MsgpackDecoder, *, bind: bool,
                 linger_ms: int = 0) -> None:
        self._decoder = decoder
        self._socket = _make_socket(ctx, zmq.PULL, address, bind, linger_ms)
        self.address = _bound_address(self._socket, address)
        self._async_socket: zmq.asyncio.Socket | None = None  # shares _socket; made on first use

    def connect(self, address: str) -> None:
        """Also take messages from `address` (a connecting receiver fair-queues its peers; each
        peer's messages keep their order)."""
        self._socket.connect(address)

    @property
    def socket(self) -> zmq.Socket:
        """For registering with a `zmq.Poller`; receive through this object only."""
        return self._socket

    def recv(self, timeout_s: float | None = None) -> T | None:
        """The next message, or None if none came within `timeout_s` (None: wait forever)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            obj = self.recv_nowait()
            if obj is not None:
                return obj
            remaining_ms = _remaining_ms(deadline)
            if remaining_ms == 0 or not self._socket.poll(remaining_ms, zmq.POLLIN):
                return None

    def recv_nowait(self) -> T | None:
        """The next message if one is waiting, else None."""
        try:
            frames = self._socket.recv_multipart(flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        return self._decoder.decode(frames)  # type: ignore[arg-type]  # zmq.Frame is a buffer

    async def recv_async(self, timeout_s: float | None = None) -> T | None:
        """Like `recv`, awaiting without blocking the running event loop."""
        if self._async_socket is None:
            self._async_socket = zmq.asyncio.Socket.from_socket(self._socket)
        shadow = self._async_socket  # pyzmq re-registers it when the running loop changes
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            obj = self.recv_nowait()
            if obj is not None:
                return obj
            remaining_ms = _remaining_ms(deadline)
            if remaining_ms == 0 or not await shadow.poll(remaining_ms, zmq.POLLIN):  # type: ignore[call-arg]
                return None

    def close(self) -> None:
        if self._async_socket is not None:
            self._async_socket.close()  # unregisters from its event loop; closes the shared socket
            self._async_socket = None
        self._socket.close()
