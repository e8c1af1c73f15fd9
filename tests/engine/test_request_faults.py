"""The engine outlives any one request (issue 40 item 6): a step that fails in one request's own
work fails that request alone (an internal error output, its blocks freed) and the other requests
of the step finish as they would have alone; a failure nobody owns still stops the rank."""

from __future__ import annotations

import pytest

from mmserve import LLM, SamplingParams
from mmserve.ipc.messages import EngineCoreRequest
from mmserve.structured_outputs import StructuredOutputsParams

POISON = StructuredOutputsParams.for_schema({"type": "object", "properties": {"poison": {"type": "integer"}}})


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def poisoned(path, request):
    """An engine whose grammar cache raises for the POISON schema (as a compile bug would); with
    --async-scheduling too (the failing step prepared while the one before it is in flight)."""
    llm = LLM(model=path, num_kv_blocks=64, async_scheduling=request.param)
    grammars = llm.engine.core.executor.runner.grammars
    real = grammars.matcher

    def matcher(spec, eos_token_id):
        if spec.key == POISON.key:
            raise RuntimeError("compiler crashed")
        return real(spec, eos_token_id)

    grammars.matcher = matcher
    return llm


def plain(tokens: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=tokens)


def test_a_poison_request_fails_alone_and_the_others_finish_unchanged(poisoned):
    prompts = ["USER: hello ASSISTANT:", "USER: write a list ASSISTANT:", "USER: poison ASSISTANT:"]
    alone = [poisoned.generate(p, plain())[0].outputs[0].token_ids for p in prompts[:2]]
    core = poisoned.engine.core
    outs = poisoned.generate(prompts, [plain(), plain(),
                                       SamplingParams(max_tokens=8, structured_outputs=POISON)])
    assert [o.outputs[0].token_ids for o in outs[:2]] == alone
    assert outs[2].outputs[0].finish_reason == "abort" and outs[2].outputs[0].token_ids == []
    assert core.kv_cache.num_free_blocks == core.kv_cache.pool.num_blocks
    core.check_integrity()
    again = poisoned.generate(prompts[0], plain())[0].outputs[0].token_ids  # the engine still steps
    assert again == alone[0]


def test_the_error_output_is_internal_and_names_the_cause(poisoned):
    core = poisoned.engine.core
    core.add_request(EngineCoreRequest("bad", [1, 2, 3], [], SamplingParams(max_tokens=4, structured_outputs=POISON),
                                       None, 0.0))
    out = []
    while not out and core.has_unfinished_requests():  # the grammar compiles off the step first
        out = core.step().outputs
    assert len(out) == 1 and out[0].error_kind == "internal" and "compiler crashed" in (out[0].error or "")
    assert not core.has_unfinished_requests()


def test_an_unowned_failure_in_a_batch_still_propagates(path, monkeypatch):
    llm = LLM(model=path, num_kv_blocks=64)
    core = llm.engine.core

    def boom(scheduled):
        raise RuntimeError("device lost")

    monkeypatch.setattr(core.executor, "execute_model", boom)

    for i in range(2):
        core.add_request(EngineCoreRequest(f"r{i}", [1, 2, 3 + i], [], SamplingParams(max_tokens=4), None, 0.0))
    with pytest.raises(RuntimeError, match="device lost"):
        core.step()


def test_an_item_that_does_not_fill_its_placeholders_fails_its_request_alone(path):
    from helpers.mm_prompts import PARAMS, one

    llm = LLM(model=path, num_kv_blocks=64)
    core = llm.engine.core
    bad = llm.engine.input_processor.process("bad", one(3), PARAMS)
    item = bad.mm_items[0]
    bad.mm_items[0] = item.__class__(item.modality, "tampered", item.data,
                                     item.placeholder.__class__(item.placeholder.offset, item.placeholder.length - 1))
    core.add_request(bad)
    core.add_request(EngineCoreRequest("good", [1, 2, 3], [], plain(4), None, 0.0))
    outputs: dict[str, list] = {}
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            outputs.setdefault(out.request_id, []).append(out)
    assert outputs["bad"][-1].error_kind == "internal" and "placeholders" in (outputs["bad"][-1].error or "")
    assert sum(len(o.new_token_ids) for o in outputs["good"]) == 4
    core.check_integrity()
