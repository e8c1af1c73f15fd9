"""`priority` through the offline API (vLLM's `LLM.generate(..., priority=[...])`) and a real engine:
under `scheduling_policy="priority"` the most urgent prompts run first, each with the tokens it
gets alone; under fcfs a priority other than 0 is a ValueError and nothing runs."""

from __future__ import annotations

import pytest

from mmserve import LLM, SamplingParams
from helpers.tiny_models import make_checkpoint, make_image

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [{"prompt": "USER: <image>\nWhat is this? ASSISTANT:", "multi_modal_data": {"image": make_image(seed)}}
           for seed in range(4)]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("llm_priority"))


def finished_order(llm: LLM, priorities: list[int]) -> tuple[list[str], dict[str, list[int]]]:
    """Queue `PROMPTS` with `priorities` at once; the order they finish in, and each one's tokens."""
    ids = [f"p{i}" for i in range(len(PROMPTS))]
    llm.engine.add_requests(ids, PROMPTS, [GREEDY] * len(PROMPTS), priorities)
    order, tokens = [], {}
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            if out.finished:
                order.append(out.request_id)
                tokens[out.request_id] = list(out.outputs[0].token_ids)
    return order, tokens


def test_the_most_urgent_prompts_run_first_with_the_tokens_they_get_alone(path):
    with LLM(model=path, max_model_len=256, max_num_seqs=1, scheduling_policy="priority") as llm:
        alone = {f"p{i}": out.outputs[0].token_ids for i, out in enumerate(llm.generate(PROMPTS, GREEDY))}
        order, tokens = finished_order(llm, [3, -1, 0, -1])
        assert order == ["p1", "p3", "p2", "p0"]  # ties in arrival order
        assert tokens == alone
        outs = llm.generate(PROMPTS, GREEDY, priority=[2, 1, 0, -9])
        assert [o.outputs[0].token_ids for o in outs] == list(alone.values())  # returned in the prompts' order
        with pytest.raises(ValueError, match="priority has 1 values for 4 prompts"):
            llm.generate(PROMPTS, GREEDY, priority=[0])


def test_under_fcfs_a_priority_is_refused_before_anything_runs(path):
    with LLM(model=path, max_model_len=256, max_num_seqs=1) as llm:
        with pytest.raises(ValueError, match="--scheduling-policy priority"):
            llm.generate(PROMPTS, GREEDY, priority=[0, 0, 5, 0])
        assert not llm.engine.has_unfinished_requests()
        order, _ = finished_order(llm, [0, 0, 0, 0])
        assert order == ["p0", "p1", "p2", "p3"]
