"""Round trips to one of the launcher's services over ipc://: a ROUTER answered by one thread, DEALERs asking.

`ServiceThread` binds the address and hands each decoded message to `handle`, sending back what it
returns (None: a one-way message); a message `handle` raises on is answered with
`on_error(seq, text)` when it asked for an answer (a non-zero `seq`), so the asker fails at once.
`Asker` is a user's side: `ask` sends a message numbered by `seq` and waits for the answer of
that number (late answers to earlier asks are dropped), raising RuntimeError when it carries an
`error` or none comes within `timeout_s`; `send` is one-way. Both are thread-safe in the way
they are used: the service's socket is the thread's alone, the asker's is under one lock.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Generic, Protocol, TypeVar

import msgspec
import zmq

logger = logging.getLogger(__name__)

_POLL_MS = 200  # how often the service thread checks that it should stop


class Answer(Protocol):
    seq: int
    error: str | None


A = TypeVar("A", bound=Answer)


class ServiceThread:
    """A ROUTER at `address` whose messages `handle` answers, in arrival order, on one thread."""

    def __init__(self, address: str, decoder: msgspec.msgpack.Decoder, handle: Callable[[Any], Any],
                 on_error: Callable[[int, str], Any], name: str) -> None:
        self.address = address
        self._decoder = decoder
        self._handle = handle
        self._on_error = on_error
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(address)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._ctx.destroy(linger=0)

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(_POLL_MS, zmq.POLLIN):
                continue
            identity, frame = self._sock.recv_multipart()
            msg: Any = None
            try:
                msg = self._decoder.decode(frame)
                answer = self._handle(msg)
            except Exception as e:  # one bad message must not stop the service for every user
                logger.exception("%s could not handle a message", self._thread.name)
                seq = getattr(msg, "seq", 0)
                if not seq:  # no ask to answer (a one-way message, or one that did not decode)
                    continue
                answer = self._on_error(seq, f"{type(e).__name__}: {e}")
            if answer is not None:
                self._sock.send_multipart([identity, msgspec.msgpack.encode(answer)])


class Asker(Generic[A]):
    """A DEALER's round trips to the service at `address` (`what` names it in errors)."""

    def __init__(self, address: str, answer_type: type[A], what: str, timeout_s: float = 10.0) -> None:
        self.what = what
        self.timeout_s = timeout_s
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(address)
        self._decoder = msgspec.msgpack.Decoder(answer_type)
        self._lock = threading.Lock()
        self._seq = 0

    def ask(self, make: Callable[[int], Any]) -> A:
        """Send `make(seq)` and return its answer; RuntimeError on the service's error or its silence."""
        with self._lock:
            self._seq += 1
            seq = self._seq
            self._sock.send(msgspec.msgpack.encode(make(seq)))
            while self._sock.poll(int(self.timeout_s * 1000), zmq.POLLIN):
                answer = self._decoder.decode(self._sock.recv())
                if answer.seq != seq:  # an answer that came too late is dropped
                    continue
                if answer.error is not None:
                    raise RuntimeError(f"{self.what} failed: {answer.error}")
                return answer
        raise RuntimeError(f"{self.what} did not answer within {self.timeout_s:g} s")

    def send(self, msg: Any) -> None:
        with self._lock:
            self._sock.send(msgspec.msgpack.encode(msg))

    def close(self) -> None:
        with self._lock:
            self._ctx.destroy(linger=0)
