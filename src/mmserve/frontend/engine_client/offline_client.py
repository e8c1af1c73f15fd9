"""The engine client the offline `LLMEngine` drives, and its in-process implementation.

`LLMEngine` (validation, abort and output processing, one code for every deployment shape) talks
to its engine cores through `OfflineClient`: `InProcessClient` steps one `EngineCore` in the
caller's process (one rank: items pass by reference, no IPC layer); `RankProcesses`
(`rank_processes.py`) drives N engine-core processes, one per data-parallel rank.
"""

from __future__ import annotations

from typing import Any, Protocol

from mmserve.cache_report import CacheReport
from mmserve.engine.core import EngineCore
from mmserve.errors import CLIENT, INTERNAL, ClientError
from mmserve.frontend.cache_resets import ResetReport
from mmserve.ipc.messages import EngineCoreOutput, EngineCoreRequest, FinishReason, ResetCaches
from mmserve.outputs import RequestOutput


class OfflineClient(Protocol):
    """Engine cores seen from the offline driver: send, abort, and collect one round of outputs.

    Contract: `add_request` either queues the request or raises having queued nothing;
    `get_outputs` returns the outputs of one engine step (of any rank; maybe none) and raises
    when an engine core failed as a whole (every request in flight is then lost: the caller
    aborts them); `finished` is told of every request whose last output was processed, and
    `abort_requests` of every request the caller gives up (unknown ids are ignored)."""

    max_model_len: int

    def known_tokens(self, mm_hash: str) -> int | None: ...

    def fetch(self, mm_hash: str) -> dict[str, Any] | None: ...

    def add_request(self, request: EngineCoreRequest, report: CacheReport) -> None: ...

    def abort_requests(self, request_ids: list[str]) -> None: ...

    def get_outputs(self) -> list[EngineCoreOutput]: ...

    def finished(self, outputs: list[RequestOutput]) -> None: ...

    def reset_caches(self, prefix: bool, encoder: bool, mm: bool, report: ResetReport) -> None: ...

    def shutdown(self) -> None: ...


class InProcessClient:
    """One rank's engine core in this process, stepped by `get_outputs` (`core`: the `EngineCore`)."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.max_model_len = core.max_model_len
        self._refused: list[EngineCoreOutput] = []

    def known_tokens(self, mm_hash: str) -> int | None:
        """Nothing is sent by hash in process: no item's tokens are known without its data."""
        return None

    def fetch(self, mm_hash: str) -> dict[str, Any] | None:
        """No other process holds processed items."""
        return None

    def add_request(self, request: EngineCoreRequest, report: CacheReport) -> None:
        """Queue it; the engine core's refusal is an error output, as from a process (`core_proc.py`)."""
        try:
            self.core.add_request(request)
        except ValueError as e:
            kind = CLIENT if isinstance(e, ClientError) else INTERNAL
            self._refused.append(EngineCoreOutput(request.request_id, [], finish_reason=FinishReason.ABORT,
                                                  error=str(e), error_kind=kind))

    def abort_requests(self, request_ids: list[str]) -> None:
        self._refused = [out for out in self._refused if out.request_id not in request_ids]
        self.core.abort_requests(request_ids)

    def get_outputs(self) -> list[EngineCoreOutput]:
        refused, self._refused = self._refused, []
        return refused + self.core.step().outputs

    def finished(self, outputs: list[RequestOutput]) -> None:
        """The engine core has already freed a finished request."""

    def reset_caches(self, prefix: bool, encoder: bool, mm: bool, report: ResetReport) -> None:
        """In process, items pass by reference: no IPC or store layer to empty for `mm`."""
        report.add(self.core.reset_caches(ResetCaches(0, prefix, encoder)))

    def shutdown(self) -> None:
        """Stop the engine core; its executor frees the model's memory."""
        self.core.shutdown()
