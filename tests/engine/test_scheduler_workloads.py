"""Random workloads through the scheduler with every policy at once (users' requests, fcfs or by
priority, n > 1, completions batches, shadows, first tokens, last and partial blocks, images,
aborts, failed steps, cache resets): its invariants (`Scheduler.check_integrity`) hold after every step, and
every request ends."""

from __future__ import annotations

import random

import pytest

from mmserve.config import SchedulerConfig
from mmserve.engine.block_hash import BlockHasher
from mmserve.engine.cache_reset import reset_caches
from mmserve.engine.kv_cache import KVCacheManager
from mmserve.engine.policies.first_tokens import FirstTokenCache
from mmserve.engine.request import Request, RequestStatus
from mmserve.engine.scheduler import Scheduler
from mmserve.ipc.items import MultiModalItem, PlaceholderRange
from mmserve.ipc.messages import EngineCoreRequest, ResetCaches
from mmserve.ipc.worker_messages import ModelRunnerOutput, SchedulerOutput
from mmserve.sampling_params import SamplingParams
from helpers.scheduler_sim import BS, IMG


def random_request(rng: random.Random, rid: str, shadow: bool, prompts: list[list[int]]) -> Request:
    """A request of one of `prompts` (repeats hit the caches), maybe with an image, maybe n > 1."""
    tokens, items = list(rng.choice(prompts)), []
    if rng.random() < 0.3 and len(tokens) > 8:
        off, length = rng.randrange(0, len(tokens) - 6), rng.randint(2, 5)
        tokens[off:off + length] = [IMG] * length
        items.append(MultiModalItem("image", f"img{rng.randrange(4)}", None, PlaceholderRange(off, length)))
    n = 1 if shadow else rng.choice([1, 1, 1, 2, 3])
    params = SamplingParams(max_tokens=rng.randint(1, 12), ignore_eos=True, temperature=rng.choice([0, 0, 1.0]),
                            n=n, seed=1 if n > 1 else None)
    message = EngineCoreRequest(rid, tokens, items, params, None, 0.0, bypass_caches=shadow,
                                priority=rng.choice([-1, 0, 0, 2]))  # ignored unless the policy is priority
    return Request.from_engine_core_request(message, BlockHasher(BS))


def random_scheduler(rng: random.Random) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=rng.choice([2, 3, 4, 8]), max_num_batched_tokens=rng.choice([8, 16, 64]),
                             scheduling_policy=rng.choice(["fcfs", "priority"]))
    kv = KVCacheManager(rng.choice([12, 16, 32]), BS, True, rng.random() < 0.7, rng.random() < 0.5)
    return Scheduler(config, kv, 128, 8, first_tokens=FirstTokenCache(16, enabled=rng.random() < 0.7))


def sync_step(s: Scheduler, rng: random.Random) -> None:
    """One step whose runner samples a random token per request at its end, or fails on one request."""
    so = s.schedule()
    if so.num_scheduled_tokens and rng.random() < 0.05:
        s.fail_step(so, rng.choice(list(so.num_scheduled_tokens)), "boom")
    else:
        done = {rid for rid in so.num_scheduled_tokens
                if s.requests[rid].num_computed_tokens == s.requests[rid].num_tokens}
        s.update_from_output(so, ModelRunnerOutput({rid: [rng.randrange(5, 50)] for rid in done}))
    s.check_integrity()


class AsyncRunner:
    """--async-scheduling's order on a scheduler: step N+1 is scheduled before N is updated from;
    the runner samples a random token for each request whose step reaches its last token, and a
    step fails on one request now and then (handled before the step in flight is updated from)."""

    def __init__(self) -> None:
        self.in_flight: tuple[SchedulerOutput, set[str]] | None = None

    def __call__(self, s: Scheduler, rng: random.Random) -> None:
        so = s.schedule()
        sampled = {rid for rid in so.num_scheduled_tokens if (r := s.requests[rid]).num_in_flight
                   and r.num_computed_tokens == r.num_tokens + r.num_in_flight - 1}
        previous, self.in_flight = self.in_flight, (so, sampled)
        if so.num_scheduled_tokens and rng.random() < 0.05:
            s.fail_step(so, rng.choice(list(so.num_scheduled_tokens)), "boom")
            self.in_flight = None
        if previous is not None:
            s.update_from_output(previous[0], ModelRunnerOutput({rid: [rng.randrange(5, 50)] for rid in previous[1]}))
        else:
            s.drain_answered()
        s.check_integrity()


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("seed", range(12))
def test_every_invariant_holds_and_every_request_ends(seed, overlap):
    rng = random.Random(seed)
    s = random_scheduler(rng)
    step = AsyncRunner() if overlap else sync_step
    prompts = [list(range(100 * k, 100 * k + rng.randint(3, 30))) for k in range(6)]
    for i in range(80):
        for _ in range(rng.choice([0, 0, 1, 2])):
            shadow = rng.random() < 0.2
            rid = (f"cmpl-{'ab' * 16}-{i % 3}" if rng.random() < 0.15 else f"r{i}") + ("-shadow" if shadow else "")
            if not s.has_request(rid):
                s.add_request(random_request(rng, rid, shadow, prompts))
        if rng.random() < 0.05 and s.requests:
            s.finish_requests([rng.choice(sorted(s.requests))], RequestStatus.FINISHED_ABORTED)
        if rng.random() < 0.05:  # a cache reset between two steps (with a step in flight too)
            reset_caches(s, ResetCaches(i, prefix=rng.random() < 0.7, encoder=rng.random() < 0.7))
            s.check_integrity()
        step(s, rng)
    for _ in range(2000):
        if not s.num_unfinished_requests:
            break
        step(s, rng)
    step(s, rng)  # the step in flight, if any
    assert s.num_unfinished_requests == 0 and not s.requests
