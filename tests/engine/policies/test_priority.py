"""`--scheduling-policy priority` (`engine/policies/priority.py: PriorityLane`): the most urgent
waiting request is admitted first (ties in arrival order, fair shares within a priority), running
requests are scheduled most urgent first, and when KV blocks run out the least urgent is preempted.
The same workloads under fcfs show the difference, so each test fails where priority is ignored."""

from __future__ import annotations

import pytest

from mmserve.config import SchedulerConfig
from mmserve.engine.kv_cache import KVCacheManager
from mmserve.engine.policies.priority import PriorityLane
from mmserve.engine.request import Request, RequestStatus
from mmserve.engine.scheduler import Scheduler
from mmserve.sampling_params import SamplingParams
from helpers.scheduler_sim import fake_step


def req(rid: str, priority: int = 0, n_prompt: int = 3, max_tokens: int = 2, order: int = 0) -> Request:
    r = Request(rid, list(range(10, 10 + n_prompt)), [], SamplingParams(max_tokens=max_tokens), None, 0.0,
                priority=priority)
    r.order = order
    return r


def sibling(cid: str, index: int, priority: int = 0) -> Request:
    r = req(f"{cid}#{index}", priority)
    r.client_id = cid
    return r


def scheduler(policy: str, num_blocks: int = 64, max_seqs: int = 8, max_tokens: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=max_tokens,
                                     scheduling_policy=policy), KVCacheManager(num_blocks, 4), 256)


def finish_order(s: Scheduler, steps: int = 200) -> list[str]:
    done: list[str] = []
    for _ in range(steps):
        if not s.num_unfinished_requests:
            return done
        _, out = fake_step(s)
        done += [o.request_id for o in out.outputs if o.finish_reason is not None]
    raise AssertionError("requests did not finish")


def test_the_most_urgent_waiting_request_comes_first_ties_in_arrival_order():
    lane = PriorityLane(8)
    lane.waiting.extend([req("a", 2), req("b", 0), req("c", -1), req("d", -1)])
    lane.next_up([])
    assert [r.request_id for r in lane.waiting] == ["c", "a", "b", "d"]
    lane.waiting.popleft()
    lane.next_up([])
    assert lane.waiting[0].request_id == "d"


def test_fair_shares_hold_within_a_priority_but_never_pass_a_more_urgent_one():
    lane = PriorityLane(4)
    running = [sibling("big", i, -1) for i in range(3)]
    lane.waiting.extend([sibling("big", 3, -1), req("other", -1), req("lax", 5)])
    lane.next_up(running)
    assert lane.waiting[0].request_id == "other"  # "big" is over its share of 4 // 3
    lane.waiting.remove(lane.waiting[0])
    lane.next_up(running)
    assert lane.waiting[0].request_id == "big#3"  # over its share, yet more urgent than "lax"


def test_over_share_never_preempts_a_more_urgent_request_for_a_less_urgent_one():
    lane = PriorityLane(2)
    running = [sibling("v", 0, -1), sibling("v", 1, -1)]
    lane.waiting.append(req("lax", 3))
    assert lane.over_share(running, running) == []  # "v" is over its share of 1, but more urgent
    lane.waiting.append(req("peer", -1))
    assert lane.over_share(running, running) == [running[-1]]


@pytest.mark.parametrize("policy, first", [("priority", ["c", "b", "a"]), ("fcfs", ["a", "b", "c"])])
def test_admission_follows_priority_only_under_the_priority_policy(policy, first):
    s = scheduler(policy, max_seqs=1)
    s.add_request(req("hold", max_tokens=3))
    fake_step(s)  # "hold" runs; the rest queue behind the one slot
    for rid, priority in (("a", 3), ("b", 0), ("c", -2)):
        s.add_request(req(rid, priority))
    assert finish_order(s) == ["hold", *first]


@pytest.mark.parametrize("policy, victim", [("priority", "lax"), ("fcfs", "urgent")])
def test_when_blocks_run_out_the_least_urgent_running_request_is_preempted(policy, victim):
    # 6 blocks of 4 tokens: two requests of 10 prompt tokens (3 blocks each) that keep growing
    s = scheduler(policy, num_blocks=6)
    s.add_request(req("lax", 5, n_prompt=10, max_tokens=8))
    s.add_request(req("urgent", -5, n_prompt=10, max_tokens=8))
    preempted = []
    for _ in range(40):
        if not s.num_unfinished_requests:
            break
        fake_step(s)
        preempted += [r.request_id for r in s.requests.values() if r.status is RequestStatus.PREEMPTED]
    assert preempted and set(preempted) == {victim}
    assert s.kv_cache.num_free_blocks == 6


@pytest.mark.parametrize("policy, turn", [("priority", {"urgent": 8}), ("fcfs", {"lax": 1, "urgent": 7})])
def test_running_requests_are_scheduled_most_urgent_first(policy, turn):
    s = scheduler(policy, max_tokens=8)
    s.add_request(req("lax", 4, max_tokens=20))
    fake_step(s)  # "lax" decodes from here on
    s.add_request(req("urgent", -4, n_prompt=30))
    fake_step(s)  # "urgent" is admitted with what the budget leaves
    so, _ = fake_step(s)
    assert so.num_scheduled_tokens == turn  # the budget goes to the first in turn


def test_siblings_keep_their_requests_priority():
    r = Request("x", [1, 2, 3], [], SamplingParams(n=2, max_tokens=1), None, 0.0, priority=-7)
    assert r.sibling(1).priority == -7


def test_a_config_names_its_policy():
    with pytest.raises(ValueError, match="scheduling_policy"):
        SchedulerConfig(scheduling_policy="lifo")
