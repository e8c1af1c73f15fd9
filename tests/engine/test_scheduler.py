"""The scheduler alone, with plain requests and no model: the runner is simulated."""

from __future__ import annotations

from mmserve.config import SchedulerConfig
from mmserve.engine.kv_cache import KVCacheManager
from mmserve.engine.request import Request, RequestStatus
from mmserve.engine.scheduler import Scheduler
from mmserve.ipc.items import MultiModalItem, PlaceholderRange
from mmserve.sampling_params import SamplingParams
from helpers.scheduler_sim import fake_step


def make_scheduler(num_blocks=64, block_size=4, max_tokens=64, max_seqs=8, max_len=256, max_item_tokens=16,
                   **config):
    """`max_item_tokens`: the largest image these tests use (the encoder budgets are at least that)."""
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=max_tokens, **config),
                     KVCacheManager(num_blocks, block_size), max_len, max_item_tokens)


def make_request(rid, n_prompt, max_tokens=4, items=(), eos=None, **params):
    mm = [MultiModalItem("image", f"{rid}-{i}", {}, PlaceholderRange(off, length))
          for i, (off, length) in enumerate(items)]
    return Request(rid, list(range(10, 10 + n_prompt)), mm, SamplingParams(max_tokens=max_tokens, **params), eos, 0.0)


def test_chunked_prefill_respects_the_budget_and_decodes_after():
    s = make_scheduler(max_tokens=8)
    s.add_request(make_request("a", 20))
    chunks = [fake_step(s)[0].num_scheduled_tokens["a"] for _ in range(3)]
    assert chunks == [8, 8, 4]
    assert s.requests["a"].num_output_tokens == 1
    so, _ = fake_step(s)
    assert so.num_scheduled_tokens == {"a": 1}


def test_running_requests_go_before_waiting_ones():
    s = make_scheduler(max_tokens=10)
    s.add_request(make_request("a", 6))
    fake_step(s)
    s.add_request(make_request("b", 30))
    so, _ = fake_step(s)
    assert list(so.num_scheduled_tokens) == ["a", "b"]
    assert so.num_scheduled_tokens == {"a": 1, "b": 9}


def test_max_num_seqs_caps_running():
    s = make_scheduler(max_seqs=2)
    for rid in "abc":
        s.add_request(make_request(rid, 3))
    so, _ = fake_step(s)
    assert set(so.num_scheduled_tokens) == {"a", "b"}


def test_stops_on_max_tokens_eos_and_stop_token_ids():
    s = make_scheduler()
    s.add_request(make_request("len", 3, max_tokens=2))
    s.add_request(make_request("eos", 3, eos=7))
    s.add_request(make_request("stop", 3, stop_token_ids=[7]))
    s.add_request(make_request("ignore", 3, max_tokens=3, eos=7, ignore_eos=True))
    reasons = {}
    for _ in range(5):
        for out in fake_step(s)[1].outputs:
            if out.finish_reason:
                reasons[out.request_id] = (out.finish_reason, out.stop_reason)
    assert reasons == {"eos": ("stop", None), "stop": ("stop", 7), "len": ("length", None), "ignore": ("length", None)}
    assert s.kv_cache.num_free_blocks == 64


def test_preemption_frees_the_last_request_and_recomputes_it():
    # 6 blocks of 4 tokens; two requests of 10 prompt tokens (3 blocks each) that keep growing
    s = make_scheduler(num_blocks=6, block_size=4, max_tokens=64)
    s.add_request(make_request("a", 10, max_tokens=8))
    s.add_request(make_request("b", 10, max_tokens=8))
    fake_step(s)
    preempted_seen = False
    for _ in range(40):
        if not s.num_unfinished_requests:
            break
        so, _ = fake_step(s)
        b = s.requests.get("b")
        if b is not None and b.status is RequestStatus.PREEMPTED:
            preempted_seen = True
            assert s.kv_cache.get_block_ids("b") == []
            assert b.num_computed_tokens == 0
        if preempted_seen and any(n.request_id == "b" for n in so.new_requests):
            resumed = next(n for n in so.new_requests if n.request_id == "b")
            assert len(resumed.token_ids) > 10  # outputs so far are recomputed
    assert preempted_seen
    assert not s.num_unfinished_requests
    assert s.kv_cache.num_free_blocks == 6


def test_encoder_runs_once_per_item_across_chunks_and_is_freed_after():
    s = make_scheduler(max_tokens=5, encoder_cache_tokens=0)  # no reuse: outputs go once consumed
    s.add_request(make_request("a", 20, items=[(3, 8), (12, 4)]))
    scheduled, freed = [], []
    for _ in range(6):
        so, _ = fake_step(s)
        scheduled.append(so.scheduled_encoder_inputs.get("a", []))
        freed.extend(so.free_encoder_ids)
    # chunks [0,5) [5,10) [10,15) [15,20): item 0 starts in chunk 1, item 1 in chunk 3
    assert scheduled[:4] == [[0], [], [1], []]
    assert freed == ["a-0", "a-1"]  # each hash once, after the step that computed its last placeholder
    assert s.requests["a"].num_output_tokens == 3  # sampled after chunk 4 and two decodes


def test_abort_frees_blocks_and_tells_the_runner():
    for cache_tokens, freed in ((0, ["a-0"]), (None, [])):  # off: dropped; on: kept for reuse, unused
        s = make_scheduler(encoder_cache_tokens=cache_tokens)
        s.add_request(make_request("a", 9, items=[(2, 4)]))
        fake_step(s)
        s.finish_requests(["a", "unknown"], RequestStatus.FINISHED_ABORTED)
        s.check_integrity()
        so = s.schedule()
        assert so.finished_request_ids == ["a"]
        assert so.free_encoder_ids == freed
        assert s.encoder_cache.held_items("a") == {}
        assert s.encoder_cache.contains("a-0") == (cache_tokens is None)
        assert s.kv_cache.num_free_blocks == 64
