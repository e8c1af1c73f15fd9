"""vLLM's beam search (`beam_search.py`: offline `LLM.beam_search`, the server's `use_beam_search`)
against a reference written here from its definition over transformers' own logits: each step
every beam's 2 x width most likely next tokens, scored by cumulative log probability over length
** length_penalty (the prompt counted, an ending EOS not), the best width that did not end going on."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from mmserve import LLM, BeamSearchParams
from helpers.hf_logits import hf_output_logits, hf_prompt_logits
from helpers.tiny_models import make_checkpoint, make_image

ITEM = {"prompt": "USER: <image>\nWhat is this? ASSISTANT:", "multi_modal_data": {"image": make_image(5)}}


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("beam"))


def reference(path: str, item: dict, params: BeamSearchParams, eos: set[int]) -> list[tuple[list[int], float]]:
    """The best beams (tokens, cumulative log probability) by the definition, from transformers' logits."""
    prompt_len = len(hf_prompt_logits(path, item)[0])

    def score(beam: tuple[list[int], float]) -> float:
        ended = beam[0][-1] in eos and not params.ignore_eos
        return beam[1] / (prompt_len + len(beam[0]) - ended) ** params.length_penalty

    beams: list[tuple[list[int], float]] = [([], 0.0)]
    ended: list[tuple[list[int], float]] = []
    for _ in range(params.max_tokens):
        candidates = []
        for tokens, cum in beams:
            logprobs = torch.log_softmax(hf_output_logits(path, item, tokens + [0])[-1], -1)
            top = torch.topk(logprobs, 2 * params.beam_width)
            candidates += [(tokens + [int(t)], cum + float(v)) for v, t in zip(top.values, top.indices)]
        candidates.sort(key=score, reverse=True)
        ended += [c for c in candidates if c[0][-1] in eos and not params.ignore_eos]
        beams = [c for c in candidates if not (c[0][-1] in eos and not params.ignore_eos)][:params.beam_width]
        if not beams:
            break
    return sorted(ended + beams, key=score, reverse=True)[:params.beam_width]


def check(out, item, path, params, eos) -> None:
    prompt_len = len(hf_prompt_logits(path, item)[0])
    want = reference(path, item, params, eos)
    got = [(s.tokens[prompt_len:], s.cum_logprob) for s in out.sequences]
    assert [t for t, _ in got] == [t for t, _ in want]
    assert [c for _, c in got] == pytest.approx([c for _, c in want], abs=1e-3)


def test_beams_equal_the_reference_over_an_image_prompt(path):
    other = {"prompt": "USER: <image>\nDescribe it. ASSISTANT:", "multi_modal_data": {"image": make_image(6)}}
    params = BeamSearchParams(beam_width=3, max_tokens=5, length_penalty=0.5)
    with LLM(model=path, max_model_len=256) as llm:
        outs = llm.beam_search([ITEM, other], params)  # two prompts' beams run as one batch each step
        eos = llm.engine.input_processor.eos_token_ids
        tokenizer = llm.get_tokenizer()
    for out, item in zip(outs, (ITEM, other)):
        check(out, item, path, params, set(eos))
        best = out.sequences[0]
        assert best.text == tokenizer.decode(best.tokens[-5:], skip_special_tokens=True)
        assert all(s.finish_reason == "length" for s in out.sequences)


def test_a_beam_that_reaches_an_eos_id_ends_there(path, tmp_path):
    """A token the beams choose made an EOS id (the generation config's list): beams end on it,
    its text not shown, and the best ended and live beams are the answer."""
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    with LLM(model=path, max_model_len=256) as llm:
        free = llm.beam_search(ITEM, params)[0]
    prompt_len = len(hf_prompt_logits(path, ITEM)[0])
    stop = free.sequences[0].tokens[prompt_len + 1]  # the best beam's second token
    copy = tmp_path / "ckpt"
    shutil.copytree(path, copy)
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, stop]}))
    with LLM(model=str(copy), max_model_len=256) as llm:
        out = llm.beam_search(ITEM, params)[0]
        ignored = llm.beam_search(ITEM, BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True))[0]
    check(out, ITEM, str(copy), params, {2, stop})
    ended = [s for s in out.sequences if s.finish_reason == "stop"]
    assert ended and all(s.tokens[-1] == stop for s in ended)
    assert [s.tokens for s in ignored.sequences] == [s.tokens for s in free.sequences]  # ignore_eos: as before


def test_bad_beam_search_params_are_refused():
    for bad in (dict(beam_width=0, max_tokens=4), dict(beam_width=11, max_tokens=4), dict(beam_width=2, max_tokens=0),
                dict(beam_width=2, max_tokens=4, length_penalty=float("nan"))):
        with pytest.raises(ValueError):
            BeamSearchParams(**bad)


@pytest.fixture(scope="module")
def server(path):
    from helpers.server_process import ServerProcess

    s = ServerProcess(path, "--max-model-len", "256", "--served-model-name", "m")
    yield s
    s.stop()


def test_the_servers_use_beam_search_answers_the_offline_beams(path, server):
    """vLLM's `use_beam_search` (n the beam width, `length_penalty`): completions and chat (an image)
    answer the n best beams, best first, as the offline API finds them for the same prompt."""
    import openai

    from mmserve.frontend.request.chat import parse_chat_messages
    from mmserve.multimodal.chat_templates import ChatTemplatePolicy
    from helpers.server_process import data_url

    image = make_image(7)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}},
                                             {"type": "text", "text": "What is this?"}]}]
    params = BeamSearchParams(beam_width=3, max_tokens=4, length_penalty=0.5)
    beams = {"n": 3, "max_tokens": 4, "extra_body": {"use_beam_search": True, "length_penalty": 0.5}}
    with LLM(model=path, max_model_len=256) as llm:
        inputs = parse_chat_messages(messages)
        rendered = llm.engine.input_processor.processor.apply_chat_template(inputs.conversation, None,
                                                                            ChatTemplatePolicy().options())
        chat_want, text_want = llm.beam_search([inputs.prompt(rendered), "USER: count to ten ASSISTANT:"], params)
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0) as client:
        text = client.completions.create(model="m", prompt="USER: count to ten ASSISTANT:", **beams)
        chat = client.chat.completions.create(model="m", messages=messages, **beams)
        assert [c.text for c in text.choices] == [s.text for s in text_want.sequences]
        assert [c.message.content for c in chat.choices] == [s.text for s in chat_want.sequences]
        assert [c.finish_reason for c in chat.choices] == [s.finish_reason for s in chat_want.sequences]
        assert text.usage.completion_tokens == 12 and chat.usage.prompt_tokens == len(chat_want.sequences[0].tokens) - 4
        neutral = client.chat.completions.create(model="m", messages=messages, top_p=1.0, frequency_penalty=0,
                                                 **beams)  # what asks for nothing is no refusal
        assert [c.message.content for c in neutral.choices] == [s.text for s in chat_want.sequences]
        for body, param in (({"stream": True}, "use_beam_search"), ({"n": 11}, "n"), ({"top_p": 0.5}, "top_p"),
                            ({"logprobs": True}, "use_beam_search"), ({"stop": ["x"]}, "stop")):
            with pytest.raises(openai.BadRequestError) as err:
                client.chat.completions.create(model="m", messages=messages, **{**beams, **body})
            assert err.value.body["param"] == param, body
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="m", prompt="hi", max_tokens=2, extra_body={"length_penalty": 2.0})
        assert err.value.body["param"] == "length_penalty"
        client.completions.create(model="m", prompt="hi", max_tokens=2, extra_body={"length_penalty": 1.0})
