"""The shadow cache verifier (`--cache-verify-rate R`): cache-served requests re-run past every cache.

It re-runs a sample of the requests that caches served, with every cache bypassed, and checks
that the caches changed nothing.

Sampling: each single-completion request is a candidate with probability R, decided at admission;
a candidate asks P1 for its first token's raw logits row (`EngineCoreRequest.return_first_logits`).
Once it has finished — and only when some cache layer hit for it (its `CacheReport`) — it is
sent once more as a shadow request (`bypass_caches`; by the verifier's owner, `AsyncLLM._shadow`,
which hands the run to `verify`): its items are processed again
from their sources and cross whole (no processor, IPC or shm cache); in P1 it reads and writes no
prefix, last-block, partial-block, first-token or encoder cache (`engine/request.py: shadow_items`) and runs last,
one at a time, only when nothing else waits (`engine/scheduler.py`). One shadow runs at a time per
API server; a candidate that finishes while one runs is not verified.

Comparison: the first token's logits (largest absolute difference, equal argmax) and, for greedy
requests, the generated tokens (the shadow generates as many, stop strings off). A mismatch is a
different argmax, different greedy tokens, or a difference above `atol` (the engine's own rounding
between a cached and a fresh prefill is far below it). Outcomes are counted in `VerifyFigures`
(`mmserve_cache_verify_total{outcome}`, `mmserve_cache_verify_max_abs_diff`); a mismatch logs a
WARNING naming the request, the layers that served it and its items' hashes. When the first-token
cache answered a request no logits exist for it: only its tokens are compared.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass
from typing import Any, Awaitable

import msgspec
import numpy as np

from mmserve.metrics import VerifyFigures
from mmserve.outputs import RequestOutput
from mmserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# the largest logit difference that still counts as equal, by dtype (a cached prefill attends in
# another order than a fresh one: float rounding only)
ATOL = {"float32": 1e-3, "bfloat16": 1e-1, "float16": 5e-2}

@dataclass
class Case:
    """A finished request to verify: what it was asked and what the caches answered."""

    request_id: str
    prompt: Any
    params: SamplingParams
    rank: int
    tokens: list[int]
    logits: bytes | None  # float32 row; None when the first-token cache answered
    layers: list[str]
    item_hashes: list[str]

    @property
    def shadow_id(self) -> str:
        return f"{self.request_id}-shadow"

    @property
    def shadow_params(self) -> SamplingParams:
        return shadow_params(self.params, len(self.tokens))


@dataclass
class Verdict:
    max_abs_diff: float | None  # None without both logits rows
    argmax_equal: bool | None
    tokens_equal: bool | None  # None when the request was not greedy

    def mismatch(self, atol: float) -> bool:
        return self.argmax_equal is False or self.tokens_equal is False or \
            (self.max_abs_diff is not None and self.max_abs_diff > atol)


class CacheVerifier:
    """Picks, runs and judges shadow re-runs of cache-served requests.

    Chooses candidates (`wants`), says which finished ones to verify (`finished`: the caches served
    them) and judges their shadow run (`verify`, which its owner hands the shadow's last output and
    first logits: the verifier runs no request itself, and a request's logits row is its own,
    `OpenRequest.first_logits`, gone with it)."""

    def __init__(self, rate: float, dtype: str, seed: int | None = None) -> None:
        self.rate = rate
        self.atol = ATOL[dtype]
        self.figures = VerifyFigures()
        self._random = random.Random(seed)
        self._case: Case | None = None  # the one under verification
        self._shadow: asyncio.Future[tuple[RequestOutput | None, bytes | None]] | None = None  # its re-run
        self._task: asyncio.Task[None] | None = None

    @property
    def busy(self) -> bool:
        """Whether a shadow run is under way (or about to start)."""
        return self._task is not None and not self._task.done()

    def wants(self, params: SamplingParams) -> bool:
        """Whether a new request is a candidate (asks for its first logits)."""
        return self.rate > 0 and params.n == 1 and self._random.random() < self.rate

    @property
    def kept(self) -> int:
        """Logits rows held (the case under verification's; 0 when none runs)."""
        return int(self.busy and self._case is not None and self._case.logits is not None)

    def finished(self, request_id: str, prompt: Any, params: SamplingParams, final: RequestOutput | None,
                 rank: int | None, logits: bytes | None) -> Case | None:
        """A candidate ended: the case to verify if caches served it.

        A candidate ended (`final` None: it failed or was aborted; `rank` None: it never reached
        one; `logits` its first-token row, None when the first-token cache answered): a case when
        caches served it and no other shadow runs (its shadow: `Case.shadow_id`, `shadow_params`, on
        `Case.rank`), else None."""
        report = final.cache_report if final is not None else None
        if final is None or report is None or not report.hit_layers or final.outputs[0].finish_reason == "abort" \
                or rank is None:
            return None
        if self.busy:
            return None
        return Case(request_id, prompt, params, rank, list(final.outputs[0].token_ids), logits, report.hit_layers,
                    list(report.item_hashes))

    def verify(self, case: Case, shadow: Awaitable[tuple[RequestOutput | None, bytes | None]]) -> None:
        """Judge `case` against its `shadow` run (its last output and first logits row), in the
        background, one at a time."""
        self._case = case
        self._shadow = asyncio.ensure_future(shadow)
        self._task = asyncio.get_running_loop().create_task(self._verify(case, self._shadow))

    async def _verify(self, case: Case, shadow: asyncio.Future[tuple[RequestOutput | None, bytes | None]]) -> None:
        try:
            final, logits = await shadow
        except Exception as e:  # e.g. an image given by uuid alone: nothing to process again
            logger.info("cache verification of %s skipped: %s", case.request_id, e)
            return
        if final is None:
            return
        verdict = compare(case, final.outputs[0].token_ids, logits)
        self._count(case, verdict)

    def _count(self, case: Case, verdict: Verdict) -> None:
        if verdict.max_abs_diff is not None:
            self.figures.max_abs_diff = max(self.figures.max_abs_diff, verdict.max_abs_diff)
        if not verdict.mismatch(self.atol):
            self.figures.matches += 1
            return
        self.figures.mismatches += 1
        logger.warning("cache verification MISMATCH for request %s: served by %s, items %s; first-token logits "
                       "max |diff| %s, argmax equal %s, greedy tokens equal %s", case.request_id,
                       ",".join(case.layers), ",".join(case.item_hashes) or "none", verdict.max_abs_diff,
                       verdict.argmax_equal, verdict.tokens_equal)

    def close(self) -> None:
        for task in (self._task, self._shadow):
            if task is not None:
                task.cancel()


def shadow_params(params: SamplingParams, num_tokens: int) -> SamplingParams:
    """The real request's parameters for its shadow run.

    The real request's parameters for its shadow: as many tokens when greedy (else one, for the
    logits), no stop strings (P0 cut the real output at one: its tokens end there), no logprobs."""
    max_tokens = max(num_tokens, 1) if params.greedy else 1
    return msgspec.structs.replace(params, max_tokens=max_tokens, min_tokens=min(params.min_tokens, max_tokens),
                                   stop=[], logprobs=None, n=1)


def compare(case: Case, shadow_tokens: list[int], shadow_logits: bytes | None) -> Verdict:
    """The real request's first logits and tokens against its shadow's."""
    diff = argmax_equal = None
    if case.logits is not None and shadow_logits is not None:
        real = np.frombuffer(case.logits, dtype=np.float32)
        fresh = np.frombuffer(shadow_logits, dtype=np.float32)
        diff = float(np.max(np.abs(real - fresh)))
        argmax_equal = int(real.argmax()) == int(fresh.argmax())
    tokens_equal = list(shadow_tokens) == case.tokens if case.params.greedy else None
    return Verdict(diff, argmax_equal, tokens_equal)
