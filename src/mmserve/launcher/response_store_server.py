"""The node's response store (`--api-server-count` > 1): one `ResponseStore` in the launcher for every API server.

A thread binds a ROUTER socket (ipc://, in the launcher's ipc directory) and applies each
`ResponsePut` / `ResponseGet` in arrival order, answering each with a `ResponseAnswer`; API servers
reach it through `entrypoints/openai/response_store_client.py: ResponseStoreClient`. One budget for
the node: `--responses-store-mb`, not x M. A message it fails on is answered with the error.
"""

from __future__ import annotations

import logging
import threading

import msgspec
import zmq

from mmserve.entrypoints.openai.response_store import ResponseStore
from mmserve.ipc.launcher_messages import ResponseAnswer, ResponseInput, ResponsePut
from mmserve.ipc.queues import ipc_address

logger = logging.getLogger(__name__)

_POLL_MS = 200  # how often the thread checks that it should stop


class ResponseStoreServer:
    """The store's owner, a thread in the launcher: binds `address` in `ipc_dir`; `start()`, `close()`."""

    def __init__(self, capacity_bytes: int, ipc_dir: str) -> None:
        self.store = ResponseStore(capacity_bytes)
        self.address = ipc_address(ipc_dir, "responses")
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(self.address)
        self._decoder = msgspec.msgpack.Decoder(ResponseInput)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mmserve-responses", daemon=True)

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
            try:
                msg = self._decoder.decode(frame)
            except msgspec.DecodeError:
                logger.exception("the response store got a message it cannot read")
                continue
            try:
                answer = self.handle(msg)
            except Exception as e:  # one bad message must not stop the store for every server
                logger.exception("the response store could not handle a message")
                answer = ResponseAnswer(msg.seq, error=f"{type(e).__name__}: {e}")
            self._sock.send_multipart([identity, msgspec.msgpack.encode(answer)])

    def handle(self, msg: ResponseInput) -> ResponseAnswer:
        if isinstance(msg, ResponsePut):
            self.store.put(msg.key, msg.data)
            return ResponseAnswer(msg.seq)
        return ResponseAnswer(msg.seq, self.store.get(msg.key))
