"""The node's response store (`--api-server-count` > 1): one `ResponseStore` in the launcher for every API server.

A thread (`ipc/round_trips.py: ServiceThread`) binds a ROUTER socket (ipc://, in the launcher's
ipc directory) and applies each `ResponsePut` / `ResponseGet` in arrival order, answering each with
a `ResponseAnswer`; API servers reach it through `entrypoints/openai/response_store_client.py:
ResponseStoreClient`. One budget for the node: `--responses-store-mb`, not x M. A message it fails
on is answered with the error.
"""

from __future__ import annotations

import msgspec

from mmserve.entrypoints.openai.response_store import ResponseStore
from mmserve.ipc.launcher_messages import ResponseAnswer, ResponseInput, ResponsePut
from mmserve.ipc.queues import ipc_address
from mmserve.ipc.round_trips import ServiceThread


class ResponseStoreServer:
    """The store's owner, a thread in the launcher: binds `address` in `ipc_dir`; `start()`, `close()`."""

    def __init__(self, capacity_bytes: int, ipc_dir: str) -> None:
        self.store = ResponseStore(capacity_bytes)
        self._service = ServiceThread(ipc_address(ipc_dir, "responses"), msgspec.msgpack.Decoder(ResponseInput),
                                      self.handle, lambda seq, error: ResponseAnswer(seq, error=error),
                                      "mmserve-responses")
        self.address = self._service.address

    def start(self) -> None:
        self._service.start()

    def close(self) -> None:
        self._service.close()

    def handle(self, msg: ResponseInput) -> ResponseAnswer:
        if isinstance(msg, ResponsePut):
            self.store.put(msg.key, msg.data)
            return ResponseAnswer(msg.seq)
        return ResponseAnswer(msg.seq, self.store.get(msg.key))
