"""The data-parallel coordinator: one routing picture for every API server (`--api-server-count`).

With M > 1 API servers and N > 1 ranks, a request must go where its prefix blocks and images
are cached whichever server took it, so the `DPRouter` lives once, in the launcher process
(`launcher/launcher.py`), in a `Coordinator` thread:

- every engine core sends it `RankStats` whenever its stats change (load, KV size);
- an API server asks with `RouteAsk` (the request with its items' data dropped: hashes,
  placeholders, tokens and salt are what routing reads) and waits for the `RouteAnswer` — one
  ZMQ round trip over ipc:// on the request path; `RouteSent` then commits the route (the
  blocks and items it leaves on that rank, its in-flight count) and `RouteLanded` ends it.
  An API server uses it through `remote_router.py: RemoteRouter` (the `Router` interface); its
  `decisions` (for /metrics) are asked for at scrape time (`DecisionsAsk`), so every server
  reports them all.
- the launcher calls `forget(rank)` when it restarts a rank (its caches start empty).

An ask the coordinator fails on is answered with the error (`RouteAnswer.error`), so the API
server fails the request at once instead of waiting out its timeout. Routes asked for but never
sent (the request failed before its send) are dropped oldest first beyond `_MAX_PENDING`. The
router is used under one lock (the thread and `forget`).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

import zmq

from mmserve.config import EngineConfig
from mmserve.frontend.dp.dp_router import DPRouter, Route
from mmserve.ipc.launcher_messages import (CoordinatorInput, DecisionsAsk, RankStats, RouteAnswer, RouteAsk,
                                           RouteLanded, RouteSent)
from mmserve.ipc.messages import EngineCoreRequest
from mmserve.ipc.queues import ipc_address
from mmserve.ipc.serial import MsgpackDecoder, MsgpackEncoder

logger = logging.getLogger(__name__)

_MAX_PENDING = 4096
_POLL_MS = 200  # how often the thread checks that it should stop
_UNKNOWN_KV_BLOCKS = 1 << 20  # a rank's KV size before its first stats


class Coordinator:
    """The launcher's routing thread: one `DPRouter` for every API server.

    Binds `route_address` (ROUTER: API servers) and `stats_address` (PULL: engine cores) in
    `ipc_dir`; `start()` runs the thread, `close()` stops it and closes the sockets."""

    def __init__(self, config: EngineConfig, ipc_dir: str) -> None:
        self.router = DPRouter(config, [_UNKNOWN_KV_BLOCKS] * config.parallel.data_parallel_size)
        self.route_address = ipc_address(ipc_dir, "coordinator")
        self.stats_address = ipc_address(ipc_dir, "rank_stats")
        self._lock = threading.Lock()
        self._pending: OrderedDict[str, tuple[Route, EngineCoreRequest]] = OrderedDict()
        self._ctx = zmq.Context()
        self._routes = self._ctx.socket(zmq.ROUTER)
        self._routes.setsockopt(zmq.LINGER, 0)
        self._routes.bind(self.route_address)
        self._stats = self._ctx.socket(zmq.PULL)
        self._stats.setsockopt(zmq.LINGER, 0)
        self._stats.bind(self.stats_address)
        self._encoder = MsgpackEncoder()
        self._decoder = MsgpackDecoder(CoordinatorInput)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mmserve-coordinator", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def forget(self, rank: int) -> None:
        with self._lock:
            self.router.forget(rank)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._routes, zmq.POLLIN)
        poller.register(self._stats, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(_POLL_MS):
                try:
                    self._serve_one(sock)
                except Exception:  # one bad message must not stop routing for everyone
                    logger.exception("the coordinator could not handle a message")

    def _serve_one(self, sock: zmq.Socket) -> None:
        frames = sock.recv_multipart()
        identity, frames = (frames[0], frames[1:]) if sock is self._routes else (None, frames)
        msg = self._decoder.decode(frames)
        try:
            with self._lock:
                answer = self._handle(msg)
        except Exception as e:  # the asker gets a reply at once, not a timeout
            if not isinstance(msg, (RouteAsk, DecisionsAsk)) or identity is None:
                raise
            logger.exception("the coordinator failed on an ask")
            rid = msg.request.request_id if isinstance(msg, RouteAsk) else msg.request_id
            answer = RouteAnswer(rid, -1, "", {}, error=f"{type(e).__name__}: {e}")
        if answer is not None and identity is not None:
            self._routes.send_multipart([identity, *self._encoder.encode(answer)], copy=False)

    def _handle(self, msg: CoordinatorInput) -> RouteAnswer | None:
        router = self.router
        if isinstance(msg, RankStats):
            stats = msg.stats
            router.set_kv_blocks(msg.rank, stats.num_total_blocks)
            used = 1 - stats.num_free_blocks / stats.num_total_blocks if stats.num_total_blocks else 0.0
            router.set_load(msg.rank, stats.num_running + stats.num_waiting, used)
        elif isinstance(msg, RouteAsk):
            route = router.route(msg.request, msg.live, msg.forced)
            self._pending[msg.request.request_id] = (route, msg.request)
            while len(self._pending) > _MAX_PENDING:
                self._pending.popitem(last=False)
            return RouteAnswer(msg.request.request_id, route.rank, route.reason, dict(router.decisions))
        elif isinstance(msg, RouteSent):
            if (pending := self._pending.pop(msg.request_id, None)) is not None:
                router.on_sent(*pending)
        elif isinstance(msg, RouteLanded):
            router.on_finished(msg.rank)
        elif isinstance(msg, DecisionsAsk):
            return RouteAnswer(msg.request_id, -1, "", dict(router.decisions))
        return None

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._ctx.destroy(linger=0)
