"""The offline API: sampling options, chat inputs, outputs, bad input, and the CLI."""

from __future__ import annotations

import base64
import io
import threading
import time

import pytest

from mmserve import LLM, SamplingParams
from mmserve.cli import main as cli_main
from helpers.tiny_models import make_checkpoint, make_image

PROMPT = "USER: <image>\nWhat is this? ASSISTANT:"
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("llm"))


@pytest.fixture(scope="module")
def llm(path):
    return LLM(model=path, max_model_len=256)


def image_prompt(seed=0):
    return {"prompt": PROMPT, "multi_modal_data": {"image": make_image(seed)}}


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_request_output_fields(llm):
    out = llm.generate([image_prompt()], GREEDY)[0]
    assert out.request_id and out.finished
    assert out.prompt == PROMPT
    assert len(out.prompt_token_ids) > 10
    completion = out.outputs[0]
    assert len(completion.token_ids) == 8 and completion.finish_reason == "length"
    assert completion.text == llm.get_tokenizer().decode(completion.token_ids, skip_special_tokens=True)


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=7, max_tokens=8, ignore_eos=True)
    alone = tokens(llm.generate([image_prompt()], p))
    batched = tokens(llm.generate([image_prompt(1), image_prompt(), image_prompt(2)],
                                  [GREEDY, p, SamplingParams(temperature=1.0, max_tokens=8)]))
    assert alone[0] == batched[1]
    other_seed = tokens(llm.generate([image_prompt()], SamplingParams(temperature=1.0, seed=8, max_tokens=8,
                                                                     ignore_eos=True)))
    assert other_seed != alone


def test_top_k_one_is_greedy(llm):
    p = SamplingParams(temperature=1.0, top_k=1, max_tokens=8, ignore_eos=True)
    assert tokens(llm.generate([image_prompt()], p)) == tokens(llm.generate([image_prompt()], GREEDY))


def test_stop_token_ids_and_stop_strings(llm):
    full = llm.generate([image_prompt()], GREEDY)[0].outputs[0]
    stop_id = full.token_ids[3]
    out = llm.generate([image_prompt()], SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[stop_id],
                                                        ignore_eos=True))[0].outputs[0]
    first = full.token_ids.index(stop_id)
    assert out.token_ids == full.token_ids[: first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)
    stop = full.text[len(full.text) // 2: len(full.text) // 2 + 2]
    if stop.strip():
        out = llm.generate([image_prompt()], SamplingParams(temperature=0.0, max_tokens=8, stop=[stop],
                                                            ignore_eos=True))[0].outputs[0]
        assert out.text == full.text[: full.text.index(stop)]
        assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    llm.engine.core.check_integrity()
    assert not llm.engine.core.has_unfinished_requests()


def test_chat_accepts_pil_data_urls_and_file_paths(llm, tmp_path):
    image = make_image(3)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    file = tmp_path / "img.png"
    file.write_bytes(buf.getvalue())
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    sources = [{"type": "image_pil", "image_pil": image},
               {"type": "image_url", "image_url": {"url": url}},
               {"type": "image_url", "image_url": {"url": f"file://{file}"}}]
    outs = [llm.chat([{"role": "user", "content": [src, {"type": "text", "text": "What is this?"}]}], GREEDY)
            for src in sources]
    assert tokens(outs[0]) == tokens(outs[1]) == tokens(outs[2])
    direct = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": image}}, GREEDY)
    assert tokens(outs[0]) == tokens(direct)


def test_chat_template_controls_equal_generate_on_transformers_rendering(llm, path, tmp_path):
    """`LLM.chat`'s vLLM arguments: a template file, its variables, a prefilled answer continued —
    the same prompt and tokens as `generate` on the text transformers renders."""
    from transformers import AutoProcessor

    template = ("{% for m in messages %}{{ m['role'] }}> {% for p in m['content'] %}{% if p['type'] == 'image' %}"
                "<image>\n{% else %}{{ p['text'] }}{% endif %}{% endfor %}\n{% endfor %}"
                "{% if add_generation_prompt %}{{ lead }}{% endif %}")
    file = tmp_path / "template.jinja"
    file.write_text(template)
    image = make_image(4)
    turn = [{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                         {"type": "text", "text": "What is this?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "It is"}]}]
    hf = AutoProcessor.from_pretrained(path)
    hf_turn = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}, turn[1]]
    for kwargs, hf_kwargs in (({"chat_template_kwargs": {"lead": "bot>"}}, {"add_generation_prompt": True,
                                                                             "lead": "bot>"}),
                              ({"add_generation_prompt": False, "continue_final_message": True},
                               {"continue_final_message": True})):
        rendered = hf.apply_chat_template(hf_turn, chat_template=template, tokenize=False, **hf_kwargs)
        out = llm.chat(turn, GREEDY, chat_template=str(file), **kwargs)[0]
        direct = llm.generate({"prompt": rendered, "multi_modal_data": {"image": image}}, GREEDY)[0]
        assert out.prompt == rendered and out.prompt_token_ids == direct.prompt_token_ids
        assert tokens([out]) == tokens([direct])
    assert rendered.endswith("assistant> It is")
    with pytest.raises(ValueError, match="cannot both be true"):
        llm.chat(turn, GREEDY, continue_final_message=True)
    # a template that prints content as a string (most text models'): the image as its token, on its line
    strings = "{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] }} {% endfor %}ASSISTANT:"
    out = llm.chat(turn[:1], GREEDY, chat_template=strings)[0]
    direct = llm.generate({"prompt": "USER: <image>\nWhat is this? ASSISTANT:", "multi_modal_data": {"image": image}},
                          GREEDY)[0]
    assert out.prompt_token_ids == direct.prompt_token_ids and tokens([out]) == tokens([direct])


def test_a_batch_is_processed_on_several_threads_with_the_same_outputs(path):
    """`generate` processes a batch's prompts at once on its input threads (new images in
    parallel), an image shared by two prompts once, with each prompt's output as if alone."""
    llm = LLM(model=path, max_model_len=256)
    try:
        seen: set[str] = set()
        process = llm.engine.input_processor.processor.process_image

        def recording(*args, **kwargs):
            seen.add(threading.current_thread().name)
            time.sleep(0.05)  # long enough for the next prompt to start on another thread
            return process(*args, **kwargs)

        inputs = llm.engine.input_processor
        inputs.processor.process_image = recording
        batch = [image_prompt(seed) for seed in (3, 4, 5, 3)]
        together = tokens(llm.generate(batch, GREEDY))
        assert len(seen) >= 2 and all(name.startswith("mmserve-inputs") for name in seen)
        assert inputs.items.num_processed == 3  # the shared image processed once
        assert together == [tokens(llm.generate([prompt], GREEDY))[0] for prompt in batch]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("bad, message", [
    ({"prompt": "x " * 400}, "max_model_len"),
    ({"prompt": PROMPT}, "image"),  # one placeholder, no image
    ({"prompt": "no placeholder", "multi_modal_data": {"image": make_image(0)}}, "image"),
    ({"prompt": PROMPT, "multi_modal_data": {"image": "not an image"}}, "image"),
    ({"prompt": PROMPT, "multi_modal_data": {"image": 42}}, "int"),
    ({"prompt": PROMPT, "multi_modal_data": {"video": 1}}, "image"),
    ({"prompt": PROMPT, "extra": 1}, "extra"),
    ({"prompt": PROMPT, "multi_modal_data": {"image": [make_image(i) for i in range(5)]}}, "limit"),
])
def test_bad_prompts_raise_and_leave_nothing_behind(llm, bad, message):
    before = tokens(llm.generate([image_prompt()], GREEDY))
    with pytest.raises(ValueError, match=message):
        llm.generate([image_prompt(1), bad], GREEDY)  # the good one is not left queued either
    core = llm.engine.core
    core.check_integrity()
    assert not core.has_unfinished_requests() and not llm.engine.has_unfinished_requests()
    assert core.kv_cache.num_free_blocks == core.kv_cache.pool.num_blocks
    assert tokens(llm.generate([image_prompt()], GREEDY)) == before


@pytest.mark.parametrize("kwargs", [{"max_tokens": 0}, {"temperature": -1.0}, {"top_p": 1.5}, {"top_k": -2}])
def test_bad_sampling_values_raise(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_unknown_sampling_parameter_is_named(llm):
    with pytest.raises(ValueError, match="bogus"):
        llm.generate([image_prompt()], {"max_tokens": 4, "bogus": 1})


def test_unknown_engine_argument_is_named(path):
    with pytest.raises(ValueError, match="max_num_sequences"):
        LLM(model=path, max_num_sequences=4)


def test_bfloat16_and_sharded_checkpoint(tmp_path_factory, llm):
    sharded = make_checkpoint(tmp_path_factory.mktemp("sharded"), max_shard_size="100KB")
    expected = tokens(llm.generate([image_prompt()], GREEDY))
    assert tokens(LLM(model=sharded).generate([image_prompt()], GREEDY)) == expected
    out = LLM(model=sharded, dtype="bfloat16").generate([image_prompt()], GREEDY)[0].outputs[0]
    assert len(out.token_ids) == 8


def test_cli_generate_prints_the_completion(path, tmp_path, capsys, llm):
    file = tmp_path / "img.png"
    make_image(4).save(file)
    assert cli_main(["generate", "--model", path, "--image", str(file), "--prompt", "What is this?",
                     "--max-tokens", "6"]) == 0
    printed = capsys.readouterr().out.strip()
    expected = llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"file://{file}"}},
                                                      {"type": "text", "text": "What is this?"}]}],
                        SamplingParams(temperature=0.0, max_tokens=6))[0].outputs[0].text
    assert printed == expected.strip()


def test_cli_reports_bad_input_as_an_error(path, capsys):
    assert cli_main(["generate", "--model", path, "--image", "/no/such/file.png"]) == 2
    assert "not a file" in capsys.readouterr().err


def test_builtin_model_output_depends_on_the_image(tmp_path, monkeypatch):
    from mmserve.multimodal.sample_image import sample_image

    monkeypatch.setenv("MMSERVE_CACHE", str(tmp_path))
    llm = LLM()  # builtin:tiny-llava, created under tmp_path
    outs = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": sample_image(variant=v)}} for v in (0, 1)],
                        SamplingParams(temperature=0.0, max_tokens=12))
    first, second = tokens(outs)
    assert first != second
    assert len(set(first)) > 3, "greedy output should not repeat one token"
