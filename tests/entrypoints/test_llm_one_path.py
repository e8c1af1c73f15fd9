"""One offline path (issue 39 item 3): `LLM` with one rank (its engine core in process) and with two
data-parallel ranks (engine-core processes) validates, fails and aborts a request alike."""

from __future__ import annotations

import os
import signal

import pytest

from mmserve import LLM, SamplingParams
from mmserve.structured_outputs import StructuredOutputsParams
from helpers.tiny_models import make_checkpoint, make_image

pytestmark = [pytest.mark.slow, pytest.mark.machine_wide]  # spawns engine-core processes (deselect with -m 'not slow')

ARGS = {"max_model_len": 256, "max_grammar_compile_s": 1e-6}  # every grammar is past its compile budget
PARAMS = SamplingParams(temperature=0.0, max_tokens=6)
SCHEMA = StructuredOutputsParams.for_schema({"type": "object", "properties": {"a": {"type": "integer"}}})


@pytest.fixture(scope="module")
def llms(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("one_path"))
    one = LLM(model=path, **ARGS)
    two = LLM(model=path, data_parallel_size=2, **ARGS)
    yield {1: one, 2: two}
    one.shutdown()
    two.shutdown()


def image_prompt(seed: int, placeholders: int = 1) -> dict:
    return {"prompt": "USER: " + "<image>" * placeholders + "\nWhat is this? ASSISTANT:",
            "multi_modal_data": {"image": make_image(seed)}}


def nothing_open(llm: LLM) -> dict:
    """What a request could leave behind in the offline driver (and, with two ranks, its flights)."""
    engine = llm.engine
    state = {"outputs": engine.has_unfinished_requests(),
             "in flight": len(engine.input_processor.items.inflight.futures)}
    if hasattr(engine.client, "sent"):
        state["flights"] = sorted(engine.client.sent)
    return state


def test_an_invalid_prompt_gets_the_same_error_and_nothing_runs(llms):
    errors = {}
    for ranks, llm in llms.items():
        cached = llm.engine.input_processor.processor_cache.stats().entries
        with pytest.raises(ValueError) as info:  # the second prompt names two images and has one
            llm.generate([image_prompt(1), image_prompt(2, placeholders=2), image_prompt(3)], PARAMS)
        errors[ranks] = str(info.value)
        assert nothing_open(llm) == {"outputs": False, "in flight": 0, **({"flights": []} if ranks == 2 else {})}
        assert llm.engine.input_processor.processor_cache.stats().entries == cached  # no item of the call was kept
    assert errors[1] == errors[2]
    assert [o.outputs[0].token_ids for o in llms[1].generate(image_prompt(1), PARAMS)] == \
        [o.outputs[0].token_ids for o in llms[2].generate(image_prompt(1), PARAMS)]


def test_a_request_the_engine_refuses_fails_alone_the_same_way(llms):
    got = {}
    for ranks, llm in llms.items():
        outs = llm.generate([image_prompt(4), "USER: hello ASSISTANT:", "USER: json please ASSISTANT:"],
                            [PARAMS, PARAMS, SamplingParams(max_tokens=6, structured_outputs=SCHEMA)])
        got[ranks] = [(o.outputs[0].finish_reason, o.outputs[0].token_ids) for o in outs]
        assert nothing_open(llm)["outputs"] is False
    assert got[1] == got[2]
    assert got[1][2] == ("abort", []) and all(len(tokens) == 6 for _, tokens in got[1][:2])
    core = llms[1].engine.core
    assert core.kv_cache.num_free_blocks == core.kv_cache.pool.num_blocks
    assert sorted(llms[2].engine.client.sent) == []


def test_a_killed_rank_is_restarted_before_the_next_call(llms):
    llm = llms[2]
    want = [o.outputs[0].token_ids for o in llms[1].generate([image_prompt(5), image_prompt(6)], PARAMS)]
    victim = llm.engine.client.ranks.client(0).proc
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(10)
    assert [o.outputs[0].token_ids for o in llm.generate([image_prompt(5), image_prompt(6)], PARAMS)] == want
    assert [r.restarts for r in llm.engine.dp_figures().ranks] == [1, 0]


def lost_device(scheduled: object) -> None:
    raise RuntimeError("device lost")


def test_an_engine_core_that_fails_fails_the_call_alike_and_the_next_call_serves(llms, monkeypatch):
    """One rank: the model's step raises (as a lost device would); two ranks: both engine-core
    processes are killed mid-call. Either way the call raises, nothing of it stays, and the next
    call gets the same answers as before."""
    prompts = [image_prompt(7), image_prompt(8)]
    want = [o.outputs[0].token_ids for o in llms[1].generate(prompts, PARAMS)]
    for ranks, llm in llms.items():
        client = llm.engine.client
        real = client.get_outputs

        def fail_once(ranks=ranks, client=client, real=real):
            monkeypatch.setattr(client, "get_outputs", real)
            if ranks == 1:
                monkeypatch.setattr(client.core.executor, "execute_model", lost_device)
            else:
                for rank in range(2):
                    os.kill(client.ranks.client(rank).proc.pid, signal.SIGKILL)
                    client.ranks.client(rank).proc.join(10)
            return real()

        monkeypatch.setattr(client, "get_outputs", fail_once)
        with pytest.raises(RuntimeError):  # EngineDeadError, with processes
            llm.generate(prompts, PARAMS)
        monkeypatch.undo()
        assert nothing_open(llm) == {"outputs": False, "in flight": 0, **({"flights": []} if ranks == 2 else {})}
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)] == want
    core = llms[1].engine.core
    assert core.kv_cache.num_free_blocks == core.kv_cache.pool.num_blocks


def test_each_reset_drops_its_layers_alike_and_every_answer_stays(llms):
    """`reset_prefix_cache`, `reset_encoder_cache`, `reset_mm_cache` (vLLM's) with one rank and two:
    each repeat after a reset shows exactly the layers it dropped missing, with the same tokens."""
    for ranks, llm in llms.items():
        prompt = image_prompt(40)
        cold = llm.generate(prompt, PARAMS)[0]
        n = len(cold.prompt_token_ids)
        mirror = {"ipc": (0, 1)} if ranks == 2 else {}  # the IPC layer exists between processes only
        assert cold.cache_report.counts == {"processor": (0, 1), **mirror, "prefix": (0, n), "encoder": (0, 1)}
        warm = {"processor": (1, 1), **({"ipc": (1, 1)} if mirror else {}), "prefix": (n, n)}
        assert repeat(llm, prompt, cold) == {**warm, "last_block": (1, 1), "first_token": (1, 1)}
        assert llm.reset_prefix_cache() is True
        assert repeat(llm, prompt, cold) == {**warm, "prefix": (0, n), "encoder": (1, 1)}  # the tower's output kept
        llm.reset_encoder_cache()
        assert repeat(llm, prompt, cold) == {**warm, "last_block": (1, 1), "first_token": (1, 1)}  # prefix computed
        llm.reset_mm_cache()
        assert repeat(llm, prompt, cold) == {**warm, "processor": (0, 1), **mirror, "last_block": (1, 1),
                                             "first_token": (1, 1)}
        llm.reset_mm_cache()
        llm.reset_encoder_cache()
        llm.reset_prefix_cache()
        assert repeat(llm, prompt, cold) == cold.cache_report.counts  # all three: as cold as the first time
        assert nothing_open(llm)["outputs"] is False


def repeat(llm: LLM, prompt: dict, cold) -> dict[str, tuple[int, int]]:
    """The prompt again: its tokens must be the cold run's; the layers' (hits, lookups)."""
    out = llm.generate(prompt, PARAMS)[0]
    assert out.outputs[0].token_ids == cold.outputs[0].token_ids
    return out.cache_report.counts


def test_each_output_carries_the_engine_cores_times(llms):
    """`RequestOutput.metrics` (vLLM's): queued, first admitted, first and last token, on the engine
    core's clock, with one rank and two."""
    for llm in llms.values():
        outs = llm.generate([image_prompt(50 + i) for i in range(3)], SamplingParams(temperature=0.0, max_tokens=5,
                                                                                      ignore_eos=True))
        for out in outs:
            t = out.metrics
            assert t is not None and t.queued_ts <= t.scheduled_ts <= t.first_token_ts <= t.last_token_ts
            assert t.prefill_s > 0 and t.decode_s > 0 and t.inference_s == pytest.approx(t.prefill_s + t.decode_s)
