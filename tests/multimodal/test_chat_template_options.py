"""vLLM's chat-template controls (multimodal/chat_templates.py): `add_generation_prompt`,
`continue_final_message`, `chat_template_kwargs` and a template of the caller's own render exactly
as transformers' `apply_chat_template` does with the same arguments, for LLaVA (the processor's
renderer) and Qwen2.5-VL's published template (the tokenizer's), content parts or one string per
message as the template reads them (vLLM's content format); what a template refuses, and a
checkpoint with no template, are `ClientError`s (400s) — a checkpoint without a template was a
plain ValueError from transformers before, a 500."""

from __future__ import annotations

import json
import os

import pytest

from helpers.published import DATA as PUBLISHED, published_qwen
from helpers.tiny_models import make_checkpoint, make_qwen_checkpoint
from mmserve.errors import ClientError
from mmserve.multimodal.chat_templates import (ChatTemplateOptions, ChatTemplatePolicy, check_template_syntax,
                                               content_format, load_chat_template)
from mmserve.multimodal.processing import create_processor

QUESTION = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
PREFILLED = QUESTION + [{"role": "assistant", "content": "It is a picture of"}]
RAISING = ("{% for m in messages %}{% if m['role'] == 'system' %}"
           "{{ raise_exception('system messages are not supported') }}{% endif %}"
           "{{ m['role'] }}: {{ m['content'] if m['content'] is string else '<image>' }}\n{% endfor %}")


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("templates")
    qwen = published_qwen(make_qwen_checkpoint(root, family="qwen2_5_vl"), root / "qwen", "qwen2.5-vl-7b-instruct")
    return {"llava": make_checkpoint(root), "qwen": qwen}


@pytest.fixture(scope="module")
def processors(paths):
    return {family: create_processor(path) for family, path in paths.items()}


@pytest.fixture(scope="module")
def reference(paths):
    """transformers' own rendering, loaded independently: LLaVA's `AutoProcessor`; Qwen's tokenizer
    with the published chat_template.json (its processor class needs torchvision)."""
    from transformers import AutoProcessor, AutoTokenizer

    llava = AutoProcessor.from_pretrained(paths["llava"])
    qwen = AutoTokenizer.from_pretrained(paths["qwen"])
    qwen_template = json.loads(open(os.path.join(paths["qwen"], "chat_template.json")).read())["chat_template"]

    def render(family: str, conversation: list[dict], **kwargs) -> str:
        if family == "llava":
            return llava.apply_chat_template(conversation, tokenize=False, **kwargs)
        return qwen.apply_chat_template(conversation, chat_template=qwen_template, tokenize=False, **kwargs)
    return render


@pytest.mark.parametrize("family", ["llava", "qwen"])
def test_each_option_renders_as_transformers_does(processors, reference, family):
    processor = processors[family]
    default = processor.apply_chat_template(QUESTION)
    assert default == reference(family, QUESTION, add_generation_prompt=True)
    bare = processor.apply_chat_template(QUESTION, options=ChatTemplateOptions(add_generation_prompt=False))
    assert bare == reference(family, QUESTION, add_generation_prompt=False) and default.startswith(bare)
    assert len(bare) < len(default)  # the assistant header is gone
    prefilled = processor.apply_chat_template(
        PREFILLED, options=ChatTemplateOptions(add_generation_prompt=False, continue_final_message=True))
    assert prefilled == reference(family, PREFILLED, continue_final_message=True)
    assert prefilled.endswith("It is a picture of")  # no end-of-turn: the model continues the sentence


def test_chat_template_kwargs_reach_the_template(processors, reference):
    qwen = processors["qwen"]
    two = QUESTION * 2
    numbered = qwen.apply_chat_template(two, options=ChatTemplateOptions(kwargs={"add_vision_id": True}))
    assert numbered == reference("qwen", two, add_generation_prompt=True, add_vision_id=True)
    assert "Picture 1: <|vision_start|>" in numbered and "Picture 2: <|vision_start|>" in numbered
    assert "Picture 1:" not in qwen.apply_chat_template(two)
    # a variable the template never reads changes nothing (and is not handed to the image processor)
    llava = processors["llava"]
    assert llava.apply_chat_template(QUESTION, options=ChatTemplateOptions(kwargs={"unused": 1})) == \
        llava.apply_chat_template(QUESTION)


@pytest.mark.parametrize("family", ["llava", "qwen"])
def test_a_template_of_the_callers_own_replaces_the_checkpoints(processors, family):
    options = ChatTemplateOptions(template="{% for m in messages %}[{{ m['role'] }}]{% endfor %}"
                                           "{% if add_generation_prompt %}{{ greeting }}{% endif %}",
                                  kwargs={"greeting": "Go:"})
    assert processors[family].apply_chat_template(QUESTION, options=options) == "[user]Go:"


@pytest.mark.parametrize("family", ["llava", "qwen"])
def test_what_a_template_refuses_is_the_clients_fault(processors, family):
    processor = processors[family]
    with pytest.raises(ClientError, match="system messages are not supported"):
        processor.apply_chat_template([{"role": "system", "content": "Be brief."}] + QUESTION,
                                      options=ChatTemplateOptions(template=RAISING))
    drops_assistants = "{% for m in messages if m['role'] == 'user' %}{{ m['role'] }}{% endfor %}"
    with pytest.raises(ClientError, match="cannot render these messages"):
        processor.apply_chat_template(PREFILLED, options=ChatTemplateOptions(
            template=drops_assistants, add_generation_prompt=False, continue_final_message=True))


def test_a_checkpoint_without_a_template_is_a_400_not_a_500(tmp_path):
    path = make_checkpoint(tmp_path)
    os.remove(os.path.join(path, "chat_template.jinja"))  # the tokenizer's config has none either
    processor = create_processor(path)
    with pytest.raises(ClientError, match="--chat-template"):
        processor.apply_chat_template(QUESTION)
    own = ChatTemplateOptions(template="{% for m in messages %}{{ m['role'] }}{% endfor %}")
    assert processor.apply_chat_template(QUESTION, options=own) == "user"


def test_options_that_exclude_each_other_or_shadow_the_renderer_are_refused():
    with pytest.raises(ClientError) as err:
        ChatTemplateOptions(add_generation_prompt=True, continue_final_message=True)
    assert err.value.param == "continue_final_message"
    for key in ("tokenize", "add_generation_prompt", "messages", "chat_template"):
        with pytest.raises(ClientError, match=key) as err:
            ChatTemplateOptions(kwargs={key: True})
        assert err.value.param == "chat_template_kwargs"
    with pytest.raises(ClientError):
        ChatTemplateOptions(kwargs=["add_vision_id"])  # type: ignore[arg-type]


def test_the_policy_trusts_a_requests_template_only_when_told():
    with pytest.raises(ClientError, match="--trust-request-chat-template") as err:
        ChatTemplatePolicy().options("{{ messages }}")
    assert err.value.param == "chat_template"
    trusting = ChatTemplatePolicy("{{ 'server' }}", True, {"a": 1, "b": 2})
    options = trusting.options("{{ 'request' }}", {"b": 3})
    assert options.template == "{{ 'request' }}" and dict(options.kwargs) == {"a": 1, "b": 3}
    assert trusting.options().template == "{{ 'server' }}"
    with pytest.raises(ClientError, match="syntax error at line 1") as err:
        trusting.options("{% for m in messages %}")
    assert err.value.param == "chat_template"
    with pytest.raises(ClientError, match="empty"):
        trusting.options("")
    with pytest.raises(ClientError, match="default_chat_template_kwargs"):
        ChatTemplatePolicy(default_kwargs={"tokenize": True})


def test_load_chat_template_reads_a_file_or_takes_a_template(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert load_chat_template(str(path)) == "{{ messages[0]['content'] }}"
    assert load_chat_template("{{ 'inline' }}") == "{{ 'inline' }}"
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    path.write_text("line one\n{% if x %}")
    with pytest.raises(ValueError, match="syntax error at line 2"):
        load_chat_template(str(path))
    # transformers' extensions parse: loop controls and the {% generation %} block
    check_template_syntax("{% for m in messages %}{% generation %}{{ m }}{% endgeneration %}{% break %}{% endfor %}")


STRING_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


def test_the_content_format_is_read_from_the_template():
    from mmserve.models.builtin import CHAT_TEMPLATE as BUILTIN_LLAVA
    from mmserve.models.builtin_qwen_vl import CHAT_TEMPLATE as BUILTIN_QWEN

    published = [json.loads(path.read_text())["chat_template"]
                 for path in PUBLISHED.glob("*/chat_template.json")]
    assert len(published) == 4
    assert all(content_format(t) == "openai" for t in [*published, BUILTIN_LLAVA, BUILTIN_QWEN])
    assert content_format(STRING_TEMPLATE) == "string" == content_format(RAISING)
    assert content_format("{% for m in messages %}{% set parts = m.content %}"
                          "{% for p in parts %}{{ p.text }}{% endfor %}{% endfor %}") == "openai"
    assert content_format("{% for m in messages %}{% for p in m['content'] | selectattr('type', 'eq', 'text') %}"
                          "{{ p.text }}{% endfor %}{% endfor %}") == "openai"


@pytest.mark.parametrize("family, image", [("llava", "<image>"),
                                           ("qwen", "<|vision_start|><|image_pad|><|vision_end|>")])
def test_a_template_that_prints_strings_gets_one_per_message(processors, family, image):
    processor = processors[family]
    conversation = QUESTION + [{"role": "assistant", "content": "A cat."},
                               {"role": "user", "content": [{"type": "text", "text": "And this?"},
                                                            {"type": "image"}]}]
    text = processor.apply_chat_template(conversation, options=ChatTemplateOptions(template=STRING_TEMPLATE))
    assert text == f"user: {image}\nWhat is this?\nassistant: A cat.\nuser: And this?\n{image}\n"
    forced = ChatTemplateOptions(template=STRING_TEMPLATE, content_format="openai")
    assert "'type': 'image'" in processor.apply_chat_template(QUESTION, options=forced)  # the list, printed
    video = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]}]
    if family == "qwen":
        assert processor.apply_chat_template(video, options=ChatTemplateOptions(template=STRING_TEMPLATE)) == \
            "user: <|vision_start|><|video_pad|><|vision_end|>\nWhat happens?\n"
    else:
        with pytest.raises(ClientError, match="no video input"):
            processor.apply_chat_template(video, options=ChatTemplateOptions(template=STRING_TEMPLATE))
    with pytest.raises(ValueError, match="content format"):
        ChatTemplateOptions(content_format="jinja")
