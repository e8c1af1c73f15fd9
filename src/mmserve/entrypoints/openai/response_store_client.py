"""An API server's side of the node's response store (`--api-server-count` > 1): the launcher's, over ipc://.

`ResponseStoreClient` has the `EncodedStore` interface (`put`, `get`); each call is one round trip
(`ipc/round_trips.py: Asker`) to `launcher/response_store_server.py`, made from `KeptResponses`'
worker thread, never the event loop. Thread-safe.
"""

from __future__ import annotations

from mmserve.ipc.launcher_messages import ResponseAnswer, ResponseGet, ResponsePut
from mmserve.ipc.round_trips import Asker


class ResponseStoreClient:
    """Puts and gets against the launcher's response store at `address`."""

    def __init__(self, address: str) -> None:
        self._asker = Asker(address, ResponseAnswer, "the node's response store")

    def put(self, key: str, data: bytes) -> None:
        self._asker.ask(lambda seq: ResponsePut(seq, key, data))

    def get(self, key: str) -> bytes | None:
        return self._asker.ask(lambda seq: ResponseGet(seq, key)).data

    def close(self) -> None:
        self._asker.close()
