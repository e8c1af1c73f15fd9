"""--async-scheduling gives the tokens the engine gives without it: step N+1 is scheduled and
prepared before step N's tokens reach the host, its decode inputs filled in once they have, across
preemption, chunked prefill, cache hits (prefix, last block, first token, encoder), stops, n > 1,
structured outputs, penalties and log probabilities, on one rank or two; an abort while a step is in
flight leaves nothing behind. (The scheduler alone, in that order, under every policy: test_scheduler_workloads.)"""

from __future__ import annotations

import pytest

from mmserve import LLM, SamplingParams
from mmserve.ipc.messages import EngineCoreRequest
from mmserve.sampling_params import StructuredOutputsParams
from helpers.tiny_models import make_checkpoint, make_image

pytestmark = pytest.mark.machine_wide  # its processes and /dev/shm are the machine's: one worker runs all such files

PROMPT = "USER: <image>\nWhat is this? ASSISTANT:"
TEXT = "USER: Say something about the weather today. ASSISTANT:"

# a small step budget (chunked prefill), small blocks and few of them (preemption)
ENGINE = dict(block_size=4, max_num_batched_tokens=48, max_num_seqs=6, enable_last_block_caching=True,
              enable_partial_block_caching=True)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("async"))


def prompts() -> list[dict]:
    """Images repeated (encoder and prefix hits) and plain text repeated (first-token answers)."""
    images = [{"prompt": PROMPT, "multi_modal_data": {"image": make_image(i % 3)}} for i in range(6)]
    return images + [{"prompt": TEXT}] * 3


def params(eos: int) -> list[SamplingParams]:
    """Greedy or seeded (tokens that do not depend on what else shares a step), every stop."""
    return [
        SamplingParams(temperature=0.0, max_tokens=9),
        SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=11, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[eos], repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, min_tokens=4),
        SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=10, structured_outputs=StructuredOutputsParams(json_object=True)),
        SamplingParams(temperature=0.0, max_tokens=5),
        SamplingParams(temperature=0.0, max_tokens=5),
        SamplingParams(temperature=0.0, max_tokens=1),
    ]


def outputs(llm: LLM) -> list:
    core = llm.engine.core
    got = llm.generate(prompts(), params(core.model_config.text.eos_token_id or 0))
    core.check_integrity()
    assert core.kv_cache.num_free_blocks == core.kv_cache.pool.num_blocks
    return [[(c.token_ids, c.finish_reason, c.logprobs) for c in o.outputs] for o in got]


def same(got: list, expected: list) -> None:
    """Tokens, finish reasons and the log probabilities' ids and ranks equal; their values within
    float32 rounding (a step's batch differs: a stopped request's extra token is computed)."""
    for request, reference in zip(got, expected, strict=True):
        for (tokens, finish, logprobs), (ref_tokens, ref_finish, ref_logprobs) in zip(request, reference, strict=True):
            assert (tokens, finish) == (ref_tokens, ref_finish)
            for position, ref_position in zip(logprobs or [], ref_logprobs or [], strict=True):
                assert {t: lp.rank for t, lp in position.items()} == {t: lp.rank for t, lp in ref_position.items()}
                assert all(abs(lp.logprob - ref_position[t].logprob) < 1e-5 for t, lp in position.items())
            assert (logprobs is None) == (ref_logprobs is None)


@pytest.mark.parametrize("num_kv_blocks", [None, 40], ids=["roomy", "preempting"])
def test_the_same_tokens_with_and_without(path, num_kv_blocks):
    sync = LLM(model=path, num_kv_blocks=num_kv_blocks, **ENGINE)
    expected = outputs(sync)
    overlapped = LLM(model=path, num_kv_blocks=num_kv_blocks, async_scheduling=True, **ENGINE)
    got = outputs(overlapped)
    if num_kv_blocks:
        assert overlapped.engine.core.scheduler.num_preemptions > 0, "the test meant to force preemption"
    same(got, expected)
    sync.shutdown()
    overlapped.shutdown()


def test_an_abort_while_a_step_is_in_flight_leaves_nothing(path):
    with LLM(model=path, async_scheduling=True, **ENGINE) as llm:
        core = llm.engine.core
        prompt = list(range(10, 40))
        decode = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
        for rid in ("a", "b"):
            core.add_request(EngineCoreRequest(rid, prompt, [], decode, None, 0.0))
        while not core.scheduler.running or core.scheduler.running[0].num_output_tokens < 2:
            core.step()
        assert core.step_in_flight and core.scheduler.requests["a"].num_in_flight
        core.abort_requests(["a"])
        tokens = [out.new_token_ids for out in core.step().outputs]
        assert tokens == [[tokens[0][0]]], "the aborted request's token in flight is dropped"
        core.abort_requests(["b"])
        while core.has_unfinished_requests():
            core.step()
        assert not core.step_in_flight and not core.executor.runner.requests
        core.check_integrity()
        assert core.kv_cache.num_free_blocks == core.kv_cache.pool.num_blocks


def test_a_step_that_fails_while_one_is_in_flight_fails_its_request_alone(path):
    """Step N+1 raises in one request's work while step N is in flight: N is collected and updated
    from, the culprit ends with an internal error, and the others decode on as they would alone."""
    decode = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    poison = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(json_object=True))
    with LLM(model=path, **ENGINE) as sync:
        alone = [o.outputs[0].token_ids for o in sync.generate([TEXT, PROMPT.replace("<image>", "")], decode)]
    with LLM(model=path, async_scheduling=True, **ENGINE) as llm:
        core = llm.engine.core
        grammars = core.executor.runner.grammars
        grammars.prepare(poison.structured_outputs, None)  # compiled: the request is scheduled when added
        grammars.matcher = lambda spec, eos: (_ for _ in ()).throw(RuntimeError("compiler crashed"))
        tokenizer = llm.get_tokenizer()
        for rid, text in (("a", TEXT), ("b", PROMPT.replace("<image>", ""))):
            core.add_request(EngineCoreRequest(rid, tokenizer(text).input_ids, [], decode, None, 0.0))
        got: dict[str, list[int]] = {"a": [], "b": []}
        while not core.step_in_flight or len(got["a"]) < 2:
            for out in core.step().outputs:
                got[out.request_id] += out.new_token_ids
        core.add_request(EngineCoreRequest("poison", [5, 6, 7, 8], [], poison, None, 0.0))
        failed = []
        while core.has_unfinished_requests():
            assert core.step_in_flight or failed, "the failure must meet a step in flight"
            for out in core.step().outputs:
                if out.error is not None:
                    failed.append((out.request_id, out.error_kind, "compiler crashed" in out.error))
                else:
                    got[out.request_id] += out.new_token_ids
        assert failed == [("poison", "internal", True)]
        assert [got["a"], got["b"]] == alone
        core.check_integrity()
        assert core.kv_cache.num_free_blocks == core.kv_cache.pool.num_blocks


def test_tensor_parallel_ranks_overlap_too(path):
    """TP = 2: each rank prepares step N+1, collects N (rank 0 sending its output) and launches N+1
    on one broadcast message; the same tokens as one rank without async scheduling."""
    with LLM(model=path, **ENGINE) as sync:
        expected = outputs(sync)
    with LLM(model=path, tensor_parallel_size=2, async_scheduling=True, **ENGINE) as tp:
        same(outputs(tp), expected)
