"""Structured-output requests wait here, off the step, until their grammar is compiled.

The engine step never compiles a grammar: `EngineCore.add_request` hands a request whose grammar
is not in the runner's cache to the gate, which compiles it in one background thread
(`GrammarCache.prepare`) and gives the request back to the scheduler once it is ready. A grammar
not compiled within `--max-grammar-compile-s` refuses its request (a client error: the schema is
too costly); the compile goes on and its grammar is cached for a request that sends it again.
With tensor parallelism the runners live in the workers: there is no gate and the workers compile
as before (P0's size limits, `schema_limits.py`, bound that cost).
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass
from typing import Any, Protocol

from mmserve.ipc.messages import EngineCoreRequest
from mmserve.structured_outputs import StructuredOutputsParams


class GrammarCompiler(Protocol):
    def prepare(self, spec: StructuredOutputsParams, eos_token_id: int | None) -> None: ...

    def ready(self, spec: StructuredOutputsParams) -> bool: ...


@dataclass
class _Held:
    request: EngineCoreRequest
    future: concurrent.futures.Future[Any]
    deadline: float


class GrammarGate:
    """Requests held until their grammar compiles; at most one compile runs at a time."""

    def __init__(self, compiler: GrammarCompiler | None, budget_s: float) -> None:
        self.compiler = compiler
        self.budget_s = budget_s
        self._held: dict[str, _Held] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    @property
    def num_held(self) -> int:
        return len(self._held)

    def holds(self, request_id: str) -> bool:
        return request_id in self._held

    def hold(self, request: EngineCoreRequest) -> bool:
        """Whether `request` waits here for its grammar (False: it may be scheduled now)."""
        spec = request.sampling_params.structured_outputs
        if spec is None or self.compiler is None or self.compiler.ready(spec):
            return False
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        future = self._pool.submit(self.compiler.prepare, spec, request.eos_token_id)
        self._held[request.request_id] = _Held(request, future, time.monotonic() + self.budget_s)
        return True

    def take(self, wait_s: float = 0.0) -> tuple[list[EngineCoreRequest], list[tuple[EngineCoreRequest, str]]]:
        """The held requests whose grammar is ready, and those refused with why (a failed
        compile, or one past the budget); waits up to `wait_s` for a compile to end."""
        if not self._held:
            return [], []
        if wait_s > 0:
            concurrent.futures.wait([h.future for h in self._held.values()], timeout=wait_s,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        ready: list[EngineCoreRequest] = []
        refused: list[tuple[EngineCoreRequest, str]] = []
        now = time.monotonic()
        for request_id, held in list(self._held.items()):
            if held.future.done():
                error = held.future.exception()
                if error is None:
                    ready.append(held.request)
                else:
                    refused.append((held.request, f"the structured-output grammar did not compile: {error}"))
            elif now > held.deadline:
                refused.append((held.request, f"the structured-output grammar did not compile within "
                                              f"{self.budget_s:g} s (--max-grammar-compile-s): simplify the schema"))
            else:
                continue
            del self._held[request_id]
        return ready, refused

    def drop(self, request_ids: list[str]) -> None:
        """Forget held requests (aborted); their compiles finish into the cache."""
        for request_id in request_ids:
            self._held.pop(request_id, None)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
