"""What crosses between the API servers (and engine cores) and the launcher's services with
`--api-server-count` > 1: the data-parallel coordinator (`launcher/coordinator.py`) and the node's
item store (`item_store/node_store.py`). The rest of the messages are in `ipc/messages.py`."""

from __future__ import annotations

import msgspec

from mmserve.ipc.items import ShmHandle
from mmserve.ipc.messages import EngineCoreRequest, SchedulerStats


# ---- engine cores and API servers -> the data-parallel coordinator (launcher/coordinator.py) -------


class RankStats(msgspec.Struct, tag="rank_stats"):
    """An engine core's stats, sent to the coordinator whenever they change."""

    rank: int
    stats: SchedulerStats


class RouteAsk(msgspec.Struct, tag="route"):
    """An API server asks which rank serves `request` (its items without data) among `live`."""

    request: EngineCoreRequest
    live: list[int]
    forced: int | None = None  # the rank the request must take (X-Data-Parallel-Rank)


class RouteSent(msgspec.Struct, tag="sent"):
    """The request routed by the last `RouteAsk` of this id is on its rank's wire."""

    request_id: str


class RouteLanded(msgspec.Struct, tag="landed"):
    """A request sent to `rank` ended."""

    rank: int


class DecisionsAsk(msgspec.Struct, tag="decisions"):
    """An API server asks for the routing decisions so far (answered with a `RouteAnswer` of rank -1)."""

    request_id: str


class RouteAnswer(msgspec.Struct, tag="answer"):
    """The rank and the reason for `request_id`; `decisions`: the coordinator's counts by reason
    so far (for /metrics)."""

    request_id: str
    rank: int
    reason: str
    decisions: dict[str, int]
    error: str | None = None  # the coordinator failed on this ask (the asker raises at once)


CoordinatorInput = RankStats | RouteAsk | RouteSent | RouteLanded | DecisionsAsk


# ---- API servers <-> the node's item store (--mm-cache-type shm, item_store/node_store.py) ----------


class StoreLookup(msgspec.Struct, tag="store_lookup"):
    """The handle of `key`, pinned for `request_id` (a counted query); with `peek`, neither counted
    nor pinned (the processor cache asking whether another server processed the item)."""

    seq: int
    key: str
    request_id: str | None = None
    peek: bool = False


class StoreReserve(msgspec.Struct, tag="store_reserve"):
    """A chunk for `nbytes` of payload under `key`, pinned for `request_id`: the asking server writes
    the payload itself, then sends `StoreSeal`. Until then nobody else finds the key."""

    seq: int
    key: str
    nbytes: int
    request_id: str


class StoreSeal(msgspec.Struct, tag="store_seal"):
    """The payload of the reserved `key` is written (`ok`), or will not be (the chunk is dropped).
    Answered, so that once a server's `put` returns every server finds the key."""

    seq: int
    key: str
    ok: bool = True


class StoreDiscard(msgspec.Struct, tag="store_discard"):
    """Drop the entries of `keys` (written for a request that never reached an engine core)."""

    keys: list[str]


class StoreFinish(msgspec.Struct, tag="store_finish"):
    """Unpin what `request_id` pinned."""

    request_id: str


class StoreDropUnused(msgspec.Struct, tag="store_drop_unused"):
    """Drop every entry no request pins (`/reset_mm_cache`); answered with `dropped`."""

    seq: int


class StoreStatsAsk(msgspec.Struct, tag="store_stats"):
    seq: int


class StoreAnswer(msgspec.Struct, tag="store_answer"):
    """To a lookup or reserve: the handle (None: absent, or refused); `fresh`: the asker must write
    the payload (a reserve that allocated), else the entry is already there. To a stats ask:
    `stats`, the store's `ShmStoreStats` fields in order. To a drop: `dropped`, the entries dropped."""

    seq: int
    handle: ShmHandle | None = None
    fresh: bool = False
    stats: list[int] | None = None
    dropped: int = 0
    error: str | None = None  # the owner failed on this ask (the asker raises at once)


StoreInput = StoreLookup | StoreReserve | StoreSeal | StoreDiscard | StoreFinish | StoreStatsAsk | StoreDropUnused


# ---- API servers <-> the node's response store (--api-server-count > 1, launcher/response_store_server.py) --


class ResponsePut(msgspec.Struct, tag="response_put"):
    """Keep `data` (a conversation's JSON) under `key` (scope and response id); answered once kept."""

    seq: int
    key: str
    data: bytes


class ResponseGet(msgspec.Struct, tag="response_get"):
    seq: int
    key: str


class ResponseAnswer(msgspec.Struct, tag="response_answer"):
    """To a get: the JSON kept under its key (None: not kept). To a put: an acknowledgement."""

    seq: int
    data: bytes | None = None
    error: str | None = None  # the owner failed on this ask (the asker raises at once)


ResponseInput = ResponsePut | ResponseGet
