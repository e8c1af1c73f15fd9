"""Offline structured outputs (the built-in random-weight model, and a tiny one): whatever the
weights, the output parses and validates against the schema (compact JSON, bounded integers),
batched with plain requests that stay as they were; each schema compiles once; unsupported
schemas are refused by name."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from mmserve import LLM, SamplingParams
from mmserve.structured_outputs import MAX_SAFE_INTEGER, StructuredOutputsParams
from helpers.tiny_models import make_image

RECEIPT = {"type": "object", "properties": {
    "store": {"type": "string", "maxLength": 16},
    "total": {"type": "number"},
    "items": {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8}, "qty": {"type": "integer"}}, "required": ["name", "qty"]}},
    "paid": {"type": "boolean"},
    "kind": {"enum": ["food", "fuel", "other"]}},
    "required": ["store", "total", "items", "paid", "kind"]}
CLICK = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer", "minimum": 0},
                                          "button": {"enum": ["left", "right"]}}, "required": ["x", "y", "button"]}


@pytest.fixture(scope="module")
def builtin():
    return LLM(model="builtin:tiny-llava", num_kv_blocks=256)


def prompts() -> list:
    return ["USER: read the receipt ASSISTANT:",
            {"prompt": "USER: <image>\nwhere to click? ASSISTANT:",
             "multi_modal_data": {"image": make_image(1, (30, 30))}},
            "USER: hello ASSISTANT:"]


def schema_params(schema: dict, max_tokens: int = 200, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, structured_outputs=StructuredOutputsParams.for_schema(schema), **kw)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_outputs_validate_whatever_the_weights_and_plain_requests_are_untouched(builtin, temperature):
    llm = builtin
    plain = SamplingParams(temperature=0.0, max_tokens=12)
    alone = llm.generate(prompts()[2], plain)[0].outputs[0].token_ids
    outs = llm.generate(prompts(), [schema_params(RECEIPT, temperature=temperature, seed=1),
                                    schema_params(CLICK, temperature=temperature, seed=2), plain])
    for out, schema in zip(outs, [RECEIPT, CLICK, None]):
        completion = out.outputs[0]
        if schema is None:
            assert completion.token_ids == alone
            continue
        assert completion.finish_reason == "stop", completion.text
        value = json.loads(completion.text)
        jsonschema.validate(value, schema)
        assert not re.search(r"\s", re.sub(r'"(\\.|[^"\\])*"', '""', completion.text))  # compact
    assert abs(json.loads(outs[1].outputs[0].text)["x"]) <= MAX_SAFE_INTEGER
    llm.engine.core.check_integrity()


def test_json_object_and_n_copies_each_valid(llm):
    spec = StructuredOutputsParams(json_object=True)
    out = llm.generate(prompts()[0], SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=400,
                                                    structured_outputs=spec))[0]
    for completion in out.outputs:
        assert isinstance(json.loads(completion.text), dict) and completion.finish_reason == "stop"


def test_each_schema_compiles_once(llm):
    runner = llm.engine.core.executor.runner
    llm.generate(prompts()[0], schema_params(CLICK, temperature=0.0))
    before = runner.grammars.num_compiles
    llm.generate(prompts()[:2], [schema_params(CLICK, temperature=0.0)] * 2)
    assert runner.grammars.num_compiles == before
    llm.generate(prompts()[0], schema_params({**CLICK, "required": ["x"]}, temperature=0.0))
    assert runner.grammars.num_compiles == before + 1


def test_preempted_structured_request_resumes_its_grammar(path):
    small = LLM(model=path, num_kv_blocks=24, block_size=4)
    outs = small.generate([prompts()[0]] * 3, [schema_params(CLICK, 80, temperature=1.0, seed=i) for i in range(3)])
    assert small.engine.core.scheduler.num_preemptions > 0
    for out in outs:
        jsonschema.validate(json.loads(out.outputs[0].text), CLICK)


@pytest.mark.parametrize("schema, word", [({"type": "object", "patternProperties": {"^a": {}}}, "patternProperties"),
                                          ({"type": "object", "properties": {"a": {"not": {}}}},
                                           "'not' at $.properties.a"),
                                          ({"type": "array", "uniqueItems": True}, "uniqueItems"),
                                          ({"type": "frob"}, "frob"), ({"$ref": "#/nowhere"}, "nowhere"),
                                          ({"properties": {"a": 3}}, "$.properties.a must be a schema")])
def test_unsupported_or_malformed_schemas_are_refused_by_name(llm, schema, word):
    with pytest.raises(ValueError) as err:
        llm.generate(prompts()[0], schema_params(schema))
    assert word in str(err.value)
    assert not llm.engine.has_unfinished_requests()


def test_the_spec_takes_one_kind():
    with pytest.raises(ValueError):
        StructuredOutputsParams()
    with pytest.raises(ValueError):
        StructuredOutputsParams(json="{}", json_object=True)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex_choice_and_grammar_hold_whatever_the_weights(builtin, temperature):
    """vLLM's other kinds: the whole output matches the regex (a newline in it included: the
    control-character mask is JSON's alone), is one of the choices, derives the grammar."""
    date = r"[0-9]{4}-[0-9]{2}-[0-9]{2}\n(AM|PM)"
    choices = ["cat", "dog", "a \"bird\"", "fish\tbowl"]
    grammar = 'root ::= "(" item ("," item){0,2} ")"\nitem ::= [a-z]{1,4} | [0-9]{1,3}'
    specs = [StructuredOutputsParams(regex=date), StructuredOutputsParams(choice=choices),
             StructuredOutputsParams(grammar=grammar), StructuredOutputsParams(json_object=True)]
    outs = builtin.generate(prompts()[:2] * 2, [SamplingParams(max_tokens=60, temperature=temperature, seed=i,
                                                               structured_outputs=spec)
                                                for i, spec in enumerate(specs)])
    texts = [out.outputs[0].text for out in outs]
    assert all(out.outputs[0].finish_reason == "stop" for out in outs), texts
    assert re.fullmatch(date, texts[0]) and texts[1] in choices, texts
    assert re.fullmatch(r"\((?:[a-z]{1,4}|[0-9]{1,3})(?:,(?:[a-z]{1,4}|[0-9]{1,3})){0,2}\)", texts[2]), texts
    assert isinstance(json.loads(texts[3]), dict)
    builtin.engine.core.check_integrity()


@pytest.mark.parametrize("spec, word", [({"regex": "[a-"}, "regex: Regex parsing error"),
                                        ({"grammar": 'start ::= "a"'}, 'root rule with name "root" is not found'),
                                        ({"grammar": 'root ::= "a" |'}, "EBNF parser error")])
def test_a_malformed_regex_or_grammar_is_refused_before_the_engine(llm, spec, word):
    with pytest.raises(ValueError, match="invalid or unsupported") as err:
        llm.generate(prompts()[0], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(**spec)))
    assert word.split(": ")[-1] in str(err.value)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("fields", [{}, {"regex": "a", "choice": ["a"]}, {"choice": []}, {"choice": ["a", ""]},
                                    {"choice": "ab"}, {"regex": ""}, {"grammar": "x" * ((64 << 10) + 1)},
                                    {"choice": ["a"] * 1025}])
def test_each_kind_is_checked_when_made(fields):
    with pytest.raises(ValueError):
        StructuredOutputsParams(**fields)


def test_the_control_character_mask_is_for_json_rows_alone(path):
    import torch
    from transformers import AutoTokenizer

    from mmserve.worker.grammar import GrammarCache, RequestGrammar, apply_grammar_masks

    tokenizer = AutoTokenizer.from_pretrained(path)
    cache = GrammarCache(path, len(tokenizer))
    eos = tokenizer.eos_token_id
    matchers = [RequestGrammar(cache.matcher(StructuredOutputsParams(json_object=True), eos)),
                RequestGrammar(cache.matcher(StructuredOutputsParams(regex="\n[a-z]"), eos))]  # a newline first
    logits = torch.zeros(3, len(tokenizer))
    apply_grammar_masks(logits, [0, 2], matchers, cache.control_tokens, [True, False])
    newlines = [t for t in cache.control_tokens.tolist() if tokenizer.decode([t]).startswith("\n")]
    assert newlines and torch.isinf(logits[0, cache.control_tokens]).all()
    assert torch.isfinite(logits[2, newlines]).any() and (logits[1] == 0).all()
