"""An API server's side of the node's response store (`--api-server-count` > 1): the launcher's, over ipc://.

`ResponseStoreClient` has the `EncodedStore` interface (`put`, `get`); each call is one round trip
to `launcher/response_store_server.py`, made from `KeptResponses`' worker thread, never the event
loop. Thread-safe (one lock around the socket).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import msgspec
import zmq

from mmserve.ipc.launcher_messages import ResponseAnswer, ResponseGet, ResponseInput, ResponsePut

_ANSWER_TIMEOUT_S = 10.0


class ResponseStoreClient:
    """Puts and gets against the launcher's response store at `address`."""

    def __init__(self, address: str) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(address)
        self._decoder = msgspec.msgpack.Decoder(ResponseAnswer)
        self._lock = threading.Lock()
        self._seq = 0

    def put(self, key: str, data: bytes) -> None:
        self._ask(lambda seq: ResponsePut(seq, key, data))

    def get(self, key: str) -> bytes | None:
        return self._ask(lambda seq: ResponseGet(seq, key)).data

    def close(self) -> None:
        with self._lock:
            self._ctx.destroy(linger=0)

    def _ask(self, make: Callable[[int], ResponseInput]) -> ResponseAnswer:
        """One round trip; RuntimeError if the owner fails or does not answer within `_ANSWER_TIMEOUT_S`."""
        with self._lock:
            self._seq += 1
            seq = self._seq
            self._sock.send(msgspec.msgpack.encode(make(seq)))
            while self._sock.poll(int(_ANSWER_TIMEOUT_S * 1000), zmq.POLLIN):
                answer = self._decoder.decode(self._sock.recv())
                if answer.seq != seq:  # an answer that came too late is dropped
                    continue
                if answer.error is not None:
                    raise RuntimeError(f"the node's response store failed: {answer.error}")
                return answer
        raise RuntimeError(f"the node's response store did not answer within {_ANSWER_TIMEOUT_S:g} s")
