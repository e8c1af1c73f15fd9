"""TP = 2 with the sampling extras: every rank processes the logits and advances the grammar
matchers alike, so log probabilities, penalties, n copies and JSON schemas give what TP = 1 gives."""

from __future__ import annotations

import json

from mmserve import LLM, SamplingParams
from mmserve.structured_outputs import StructuredOutputsParams
from helpers.tiny_models import make_checkpoint, make_image

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
          "required": ["n", "ok"]}


def run(llm: LLM) -> list:
    image = {"prompt": "USER: <image>\nWhat is this? ASSISTANT:",
             "multi_modal_data": {"image": make_image(0, (40, 40))}}
    params = [SamplingParams(temperature=0.0, max_tokens=5, logprobs=3, frequency_penalty=1.0, repetition_penalty=1.3),
              SamplingParams(temperature=1.0, seed=3, max_tokens=5, n=2),
              SamplingParams(temperature=0.0, max_tokens=60,
                             structured_outputs=StructuredOutputsParams.for_schema(SCHEMA))]
    outs = llm.generate([image, image, "USER: json please ASSISTANT:"], params)
    return [[(c.token_ids, [{t: round(lp.logprob, 4) for t, lp in e.items()} for e in c.logprobs or []])
             for c in out.outputs] for out in outs]


def test_tp2_sampling_extras_equal_tp1(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("tp_sampling"))
    ref = run(LLM(model=path, num_kv_blocks=64))
    tp = LLM(model=path, tensor_parallel_size=2, num_kv_blocks=64)
    try:
        got = run(tp)
    finally:
        tp.engine.core.shutdown()
    assert got == ref
    assert len(ref[1]) == 2 and len(ref[0][0][1]) == 5
    text = tp.get_tokenizer().decode(got[2][0][0], skip_special_tokens=True)
    assert set(json.loads(text)) == {"n", "ok"}
