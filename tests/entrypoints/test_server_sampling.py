"""Issue 17 through a real server with the official client: /v1/completions, logprobs, n, the
penalties, min_tokens, logit_bias, vLLM's allowed_token_ids, bad_words, return_token_ids and
truncate_prompt_tokens, response_format and vLLM's structured_outputs / guided_* fields, whole
and streamed, each equal to what the offline engine gives for the same parameters; invalid
values are 400s with OpenAI's error body."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from mmserve import LLM, SamplingParams
from helpers.server_process import ServerProcess, data_url, messages
from helpers.tiny_models import make_checkpoint, make_image

SCHEMA = {"type": "object", "properties": {"label": {"enum": ["cat", "dog"]}, "count": {"type": "integer"},
                                           "note": {"type": "string", "maxLength": 10}},
          "required": ["label", "count", "note"]}
PROMPT = "USER: write a short note ASSISTANT:"


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("server_sampling"))


@pytest.fixture(scope="module")
def server(model_path):
    s = ServerProcess(model_path, "--max-model-len", "256", "--served-model-name", "m", "--block-size", "4")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def offline(model_path):
    return LLM(model=model_path, max_model_len=256, block_size=4)


def chat_messages():
    return messages(data_url(make_image(3)), "Describe it.")


def test_completions_whole_and_streamed_equal_offline(client, offline):
    ref = offline.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8, logprobs=2))[0]
    whole = client.completions.create(model="m", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2)
    choice = whole.choices[0]
    assert choice.text == ref.outputs[0].text and whole.object == "text_completion"
    assert whole.usage.prompt_tokens == len(ref.prompt_token_ids) and whole.usage.completion_tokens == 8
    expected = [e[t].logprob for t, e in zip(ref.outputs[0].token_ids, ref.outputs[0].logprobs)]
    assert choice.logprobs.token_logprobs == pytest.approx(expected, abs=1e-5)
    assert all(len(top) == 2 for top in choice.logprobs.top_logprobs) and len(choice.logprobs.tokens) == 8
    assert "".join(choice.logprobs.tokens) == choice.text
    chunks = list(client.completions.create(model="m", prompt=[PROMPT], max_tokens=8, temperature=0, logprobs=2,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    streamed = [lp for c in chunks if c.choices and c.choices[0].logprobs
                for lp in c.choices[0].logprobs.token_logprobs]
    # the repeat computes only its last prompt token (a copied last block): float32 rounding differs
    assert streamed == pytest.approx(choice.logprobs.token_logprobs, abs=1e-5)
    assert chunks[-1].usage.completion_tokens == 8 and [c.choices[0].finish_reason for c in chunks if c.choices][-1]


def test_completions_with_a_list_of_prompts(client, offline):
    prompts = [PROMPT, "USER: count to three ASSISTANT:"]
    refs = offline.generate(prompts, SamplingParams(temperature=1.0, seed=4, max_tokens=5, n=2))
    whole = client.completions.create(model="m", prompt=prompts, max_tokens=5, temperature=1.0, seed=4, n=2)
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    assert [c.text for c in whole.choices] == [c.text for ref in refs for c in ref.outputs]
    assert whole.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in refs)
    assert whole.usage.completion_tokens == sum(len(c.token_ids) for r in refs for c in r.outputs)
    texts: dict[int, str] = {}
    for chunk in client.completions.create(model="m", prompt=prompts, max_tokens=5, temperature=1.0, seed=4, n=2,
                                           stream=True):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert [texts[i] for i in range(4)] == [c.text for c in whole.choices]


def test_chat_logprobs_whole_and_streamed(client, offline):
    ref = offline.chat(chat_messages(), SamplingParams(temperature=0.0, max_tokens=6, logprobs=3))[0].outputs[0]
    whole = client.chat.completions.create(model="m", messages=chat_messages(), max_tokens=6, temperature=0,
                                           logprobs=True, top_logprobs=3).choices[0]
    content = whole.logprobs.content
    assert [c.logprob for c in content] == pytest.approx([e[t].logprob for t, e in zip(ref.token_ids, ref.logprobs)],
                                                         abs=1e-5)
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob >= c.logprob for c in content)
    assert "".join(c.token for c in content) == whole.message.content == ref.text
    assert bytes(content[0].bytes).decode() == content[0].token
    stream = client.chat.completions.create(model="m", messages=chat_messages(), max_tokens=6, temperature=0,
                                            logprobs=True, top_logprobs=3, stream=True)
    streamed = [c.logprob for chunk in stream for choice in chunk.choices if choice.logprobs
                for c in choice.logprobs.content]
    assert streamed == pytest.approx([c.logprob for c in content], abs=1e-5)  # as above: a repeat


def test_n_choices_whole_and_streamed_share_the_prompt(client, offline, server):
    kw = dict(model="m", messages=chat_messages(), max_tokens=6, temperature=1.0, seed=9, n=3)
    whole = client.chat.completions.create(**kw)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    ref = offline.chat(chat_messages(), SamplingParams(temperature=1.0, seed=9, max_tokens=6, n=3))[0]
    assert [c.message.content for c in whole.choices] == [c.text for c in ref.outputs]
    assert whole.usage.completion_tokens == sum(len(c.token_ids) for c in ref.outputs)
    texts = {0: "", 1: "", 2: ""}
    finished = set()
    for chunk in client.chat.completions.create(**kw, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert texts == {c.index: c.message.content for c in whole.choices} and finished == {0, 1, 2}
    text = client.completions.create(model="m", prompt=PROMPT, max_tokens=4, n=2, temperature=1.0, seed=1)
    assert len(text.choices) == 2 and text.usage.completion_tokens == 8


def test_penalties_min_tokens_and_logit_bias_equal_offline(client, offline):
    extra = {"repetition_penalty": 1.4, "min_tokens": 3}
    params = SamplingParams(temperature=0.0, max_tokens=6, presence_penalty=0.8, frequency_penalty=0.5,
                            logit_bias={11: 5.0}, **extra)
    ref = offline.generate(PROMPT, params)[0].outputs[0].text
    got = client.completions.create(model="m", prompt=PROMPT, max_tokens=6, temperature=0, presence_penalty=0.8,
                                    frequency_penalty=0.5, logit_bias={"11": 5.0}, extra_body=extra)
    plain = client.completions.create(model="m", prompt=PROMPT, max_tokens=6, temperature=0)
    assert got.choices[0].text == ref != plain.choices[0].text


def test_allowed_token_ids_and_bad_words_equal_offline(client, offline):
    """vLLM's two fields reach the sampler: the same tokens as offline, and not the free answer."""
    plain = client.completions.create(model="m", prompt=PROMPT, max_tokens=6, temperature=0)
    word = plain.choices[0].text.split()[1]
    for extra in ({"allowed_token_ids": list(range(40, 90))}, {"bad_words": [word]}):
        ref = offline.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=6, **extra))[0].outputs[0].text
        got = client.completions.create(model="m", prompt=PROMPT, max_tokens=6, temperature=0, extra_body=extra)
        assert got.choices[0].text == ref != plain.choices[0].text
    with pytest.raises(openai.BadRequestError, match="allowed_token_ids"):
        client.completions.create(model="m", prompt=PROMPT, max_tokens=2, extra_body={"allowed_token_ids": [10**7]})


def test_return_token_ids_whole_and_streamed_equal_offline(client, offline):
    """vLLM's `return_token_ids`: the prompt's ids and each choice's, whole and streamed (the prompt's
    in the first chunk, each chunk its new tokens), equal to the offline engine's; asked for nothing,
    no answer carries the fields."""
    params = SamplingParams(temperature=0.0, max_tokens=6)
    ref = offline.chat(chat_messages(), params)[0]
    ask = dict(model="m", messages=chat_messages(), max_tokens=6, temperature=0, extra_body={"return_token_ids": True})
    whole = client.chat.completions.create(**ask)
    assert whole.prompt_token_ids == ref.prompt_token_ids
    assert whole.choices[0].token_ids == ref.outputs[0].token_ids
    chunks = list(client.chat.completions.create(**ask, stream=True))
    assert chunks[0].prompt_token_ids == ref.prompt_token_ids
    assert all(getattr(c, "prompt_token_ids", None) is None for c in chunks[1:])
    assert [t for c in chunks for t in (getattr(c.choices[0], "token_ids", None) or [])] == ref.outputs[0].token_ids
    plain = client.chat.completions.create(model="m", messages=chat_messages(), max_tokens=2).model_dump()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]

    prompts = [PROMPT, "USER: name a colour ASSISTANT:"]
    refs = offline.generate(prompts, params)
    for stream in (False, True):
        got = client.completions.create(model="m", prompt=prompts, max_tokens=6, temperature=0, stream=stream,
                                        extra_body={"return_token_ids": True})
        choices: dict[int, dict] = {}
        for part in (got if stream else [got]):
            for c in part.choices:
                seen = choices.setdefault(c.index, {"prompt": None, "tokens": []})
                seen["prompt"] = seen["prompt"] or getattr(c, "prompt_token_ids", None)
                seen["tokens"] += getattr(c, "token_ids", None) or []
        assert [choices[i]["prompt"] for i in (0, 1)] == [r.prompt_token_ids for r in refs]
        assert [choices[i]["tokens"] for i in (0, 1)] == [r.outputs[0].token_ids for r in refs]


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema_and_json_object(client, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}
    for response_format, schema in ((fmt, SCHEMA), ({"type": "json_object"}, {"type": "object"})):
        r = client.chat.completions.create(model="m", messages=chat_messages(), max_tokens=150, temperature=1.0,
                                           seed=2, response_format=response_format, stream=stream)
        text = ("".join(c.choices[0].delta.content or "" for c in r if c.choices) if stream
                else r.choices[0].message.content)
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("field", ["structured_outputs", "guided"])
def test_vllms_structured_outputs_fields_choice_regex_and_json(client, field):
    """vLLM's `structured_outputs` object and its older `guided_*` names, on chat and completions:
    a classification by choice (the catalogue-captioning case), a regex, a schema, each held."""
    def body(kind: str, value: object) -> dict:
        return {"structured_outputs": {kind: value}} if field == "structured_outputs" else {f"guided_{kind}": value}

    labels = ["cat", "dog", "neither"]
    r = client.chat.completions.create(model="m", messages=chat_messages(), max_tokens=8, temperature=1.0, seed=3,
                                       extra_body=body("choice", labels))
    assert r.choices[0].message.content in labels and r.choices[0].finish_reason == "stop"
    code = r"[A-Z]{2}-[0-9]{3}"
    for stream in (False, True):
        c = client.completions.create(model="m", prompt=PROMPT, max_tokens=12, temperature=1.0, seed=4,
                                      stream=stream, extra_body=body("regex", code))
        text = "".join(x.choices[0].text for x in c if x.choices) if stream else c.choices[0].text
        assert re.fullmatch(code, text), text
    r = client.chat.completions.create(model="m", messages=chat_messages(), max_tokens=150, temperature=1.0, seed=2,
                                       extra_body=body("json", SCHEMA))
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


def test_echo_gives_the_prompt_and_its_logprobs_as_lm_eval_reads_them(client, offline):
    """lm-evaluation-harness scores a continuation with `echo`, `logprobs` 1 and `max_tokens` 1: the
    choice's lists start with the prompt's tokens (the first null), each the offline engine's
    prompt log probability; a warm prefix cache changes nothing (the prompt is computed whole)."""
    ref = offline.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=1, logprobs=1, prompt_logprobs=1))[0]
    n, out = len(ref.prompt_token_ids), ref.outputs[0]
    expected = [e[t].logprob for t, e in zip(ref.prompt_token_ids[1:], ref.prompt_logprobs[1:])]
    expected.append(out.logprobs[0][out.token_ids[0]].logprob)
    client.completions.create(model="m", prompt=PROMPT, max_tokens=1, temperature=0)  # the prompt cached
    for stream in (False, True):
        r = client.completions.create(model="m", prompt=PROMPT, max_tokens=1, temperature=0, logprobs=1, echo=True,
                                      stream=stream)
        chunks = list(r) if stream else [r]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        lists = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
        tokens = [t for lp in lists for t in lp.tokens]
        values = [v for lp in lists for v in lp.token_logprobs]
        tops = [t for lp in lists for t in lp.top_logprobs]
        assert text == PROMPT + out.text and len(tokens) == n + 1
        assert values[0] is None and tops[0] is None and values[1:] == pytest.approx(expected, abs=1e-5)
        assert all(len(top) == 1 for top in tops[1:])
        assert "".join(tokens[1:]) == offline.get_tokenizer().decode(ref.prompt_token_ids[1:] + out.token_ids)
        if not stream:
            assert r.usage.prompt_tokens == n and r.usage.completion_tokens == 1
    two = client.completions.create(model="m", prompt=[PROMPT, "USER: hi ASSISTANT:"], max_tokens=2, temperature=0,
                                    echo=True, n=2)
    prompts = [PROMPT, PROMPT, "USER: hi ASSISTANT:", "USER: hi ASSISTANT:"]
    assert [c.text.startswith(p) and c.logprobs is None for c, p in zip(two.choices, prompts)] == [True] * 4


def test_echo_with_max_tokens_0_answers_the_prompt_alone(client, offline):
    """vLLM's (and OpenAI's legacy scoring clients') `echo` with `max_tokens` 0: the prompt's text and
    its tokens' log probabilities alone, no completion tokens in usage; whole and streamed. Without
    `echo`, max_tokens 0 is a 400 naming it."""
    ref = offline.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1))[0]
    expected = [e[t].logprob for t, e in zip(ref.prompt_token_ids[1:], ref.prompt_logprobs[1:])]
    for stream in (False, True):
        extra = {"stream_options": {"include_usage": True}} if stream else {}
        r = client.completions.create(model="m", prompt=PROMPT, max_tokens=0, logprobs=1, echo=True, stream=stream,
                                      extra_body=extra)
        chunks = list(r) if stream else [r]
        lists = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
        values = [v for lp in lists for v in lp.token_logprobs]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == PROMPT
        assert values[0] is None and values[1:] == pytest.approx(expected, abs=1e-5)
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
        usage = chunks[-1].usage
        assert usage.completion_tokens == 0 and usage.prompt_tokens == len(ref.prompt_token_ids)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="m", prompt=PROMPT, max_tokens=0)
    assert "max_tokens" in err.value.body["message"]


def test_prompt_logprobs_on_chat_and_completions_are_the_offline_engines(client, offline):
    """vLLM's `prompt_logprobs` K: chat's at the top level, completions' per choice; each prompt
    token's entry (the first None) as the offline engine scores the same prompt; refused in a stream."""
    ref = offline.chat(chat_messages(), SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2))[0]
    r = client.chat.completions.create(model="m", messages=chat_messages(), max_tokens=2, temperature=0,
                                       extra_body={"prompt_logprobs": 2})
    got = r.model_extra["prompt_logprobs"]
    assert len(got) == len(ref.prompt_token_ids) and got[0] is None and r.usage.prompt_tokens == len(got)
    for token, entry, want in zip(ref.prompt_token_ids[1:], got[1:], ref.prompt_logprobs[1:]):
        assert {int(t) for t in entry} == set(want) and str(token) in entry
        assert [entry[str(t)]["logprob"] for t in want] == pytest.approx([lp.logprob for lp in want.values()], abs=1e-5)
        assert [entry[str(t)]["rank"] for t in want] == [lp.rank for lp in want.values()]
    text = offline.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0))[0]
    c = client.completions.create(model="m", prompt=PROMPT, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 0}).choices[0]
    assert c.text == text.outputs[0].text and not c.text.startswith(PROMPT)  # not echoed
    scored = [None if e is None else {int(t): v["logprob"] for t, v in e.items()}
              for e in c.model_extra["prompt_logprobs"]]
    assert scored == [None] + [{t: pytest.approx(lp.logprob, abs=1e-5) for t, lp in e.items()}
                               for e in text.prompt_logprobs[1:]]
    plain = client.chat.completions.create(model="m", messages=chat_messages(), max_tokens=2, temperature=0)
    assert "prompt_logprobs" not in plain.model_extra
    for stream_call in (lambda: client.chat.completions.create(model="m", messages=chat_messages(), max_tokens=2,
                                                               stream=True, extra_body={"prompt_logprobs": 1}),
                        lambda: client.completions.create(model="m", prompt=PROMPT, max_tokens=2, stream=True,
                                                          extra_body={"prompt_logprobs": 1})):
        with pytest.raises(openai.BadRequestError) as err:
            stream_call()
        assert err.value.body["param"] == "prompt_logprobs"


def test_prompts_of_token_ids_answer_as_their_text(client, offline):
    """A completion's prompt as token ids (one list, or a batch of lists, as lm-evaluation-harness
    sends them) answers as the same ids offline (`{"prompt_token_ids": ...}`) and as the text they
    spell; echoed, the ids are decoded."""
    params = SamplingParams(temperature=0.0, max_tokens=6)
    ref = offline.generate(PROMPT, params)[0]
    ids = ref.prompt_token_ids
    by_ids = offline.generate({"prompt_token_ids": ids}, params)[0]
    assert by_ids.outputs[0].token_ids == ref.outputs[0].token_ids and by_ids.prompt is None
    one = client.completions.create(model="m", prompt=ids, max_tokens=6, temperature=0)
    assert one.choices[0].text == ref.outputs[0].text and one.usage.prompt_tokens == len(ids)
    batch = client.completions.create(model="m", prompt=[ids, ids[:5]], max_tokens=6, temperature=0, echo=True)
    short = offline.generate({"prompt_token_ids": ids[:5]}, params)[0].outputs[0].text
    decode = offline.get_tokenizer().decode
    assert [c.text for c in batch.choices] == [decode(ids) + ref.outputs[0].text, decode(ids[:5]) + short]
    for bad in ([], [[1, 2], []], [10**6], [-1]):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="m", prompt=bad, max_tokens=2)
        assert err.value.status_code == 400 and err.value.body["message"]
    with pytest.raises(ValueError, match="token ids"):
        offline.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": make_image(1)}}, params)


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(client, offline):
    """vLLM's `truncate_prompt_tokens`: a completion answers as its prompt's last K token ids do
    offline; -1 fits a prompt longer than the context into it (255 of max_model_len 256); a chat
    with an image may drop text before the image, counted in the image's tokens too."""
    params = SamplingParams(temperature=0.0, max_tokens=6)
    ids = offline.generate(PROMPT, params)[0].prompt_token_ids
    ref = offline.generate({"prompt_token_ids": ids[-5:]}, params)[0].outputs[0].text
    cut = client.completions.create(model="m", prompt=PROMPT, max_tokens=6, temperature=0,
                                    extra_body={"truncate_prompt_tokens": 5})
    assert cut.choices[0].text == ref and cut.usage.prompt_tokens == 5
    long = PROMPT * 40  # more tokens than max_model_len
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="m", prompt=long, max_tokens=1)
    fitted = client.completions.create(model="m", prompt=long, max_tokens=1, extra_body={"truncate_prompt_tokens": -1})
    assert fitted.usage.prompt_tokens == 255
    whole = client.chat.completions.create(model="m", messages=chat_messages(), max_tokens=1)
    kept = client.chat.completions.create(model="m", messages=chat_messages(), max_tokens=1,
                                          extra_body={"truncate_prompt_tokens": whole.usage.prompt_tokens - 1})
    assert kept.usage.prompt_tokens == whole.usage.prompt_tokens - 1


@pytest.mark.parametrize("kind, body, param", [
    ("chat", {"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "guided_choice"),
    ("chat", {"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
    ("text", {"guided_regex": "(ab"}, "guided_regex"),
    ("text", {"guided_grammar": 'start ::= "a"'}, "guided_grammar"),
    ("text", {"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs"),
    ("text", {"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs"),
    ("chat", {"guided_choice": []}, "guided_choice"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"n": 0}, None),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
     "response_format"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
     "response_format"),
    ("chat", {"presence_penalty": 3}, None),
    ("text", {"logprobs": 21}, "logprobs"),
    ("text", {"n": 0}, None),
    ("text", {"echo": True, "logprobs": 21}, "logprobs"),
    ("chat", {"prompt_logprobs": 21}, "prompt_logprobs"),
    ("text", {"prompt": ["a"] * 65, "n": 2}, "n"),
    ("chat", {"priority": 1}, "priority"),  # needs --scheduling-policy priority, as in vLLM
    ("text", {"priority": -(2**70)}, "priority"),
    ("text", {"truncate_prompt_tokens": 0}, None),
    ("text", {"truncate_prompt_tokens": -2}, None),
    ("text", {"truncate_prompt_tokens": 257}, None),  # more than max_model_len, as vLLM refuses it
    ("chat", {"truncate_prompt_tokens": 3}, None),  # would cut into the image
])
def test_invalid_values_are_400_with_the_openai_body(client, kind, body, param):
    with pytest.raises(openai.BadRequestError) as err:
        if kind == "chat":
            client.chat.completions.create(model="m", messages=chat_messages(), max_tokens=2, extra_body=body)
        else:
            client.completions.create(model="m", prompt=body.pop("prompt", PROMPT), max_tokens=2, extra_body=body)
    error = err.value.body
    assert err.value.status_code == 400 and error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param and error["code"] in ("invalid_value", "unsupported_parameter")
    assert client.completions.create(model="m", prompt=PROMPT, max_tokens=1).choices[0].text is not None
