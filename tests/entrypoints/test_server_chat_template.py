"""vLLM's chat-template controls through the real server (tiny LLaVA): `--chat-template` (a file),
`--default-chat-template-kwargs`, `--trust-request-chat-template`, and a request's
`add_generation_prompt`, `continue_final_message` (with `echo`), `chat_template_kwargs` and `chat_template`,
content given to the template as parts or as one string, as the template reads it; a Thinking
template turns `reasoning_content` on.

Each chat answer is checked against /v1/completions on the text transformers' own
`apply_chat_template` renders with the same template and arguments: the same prompt tokens and the
same greedy tokens. What the template refuses (its `raise_exception`), contradictory fields, a
reserved variable and a request template with a syntax error are 400s with OpenAI's error body,
and the server goes on serving."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from helpers.server_process import ServerProcess
from helpers.tiny_models import make_checkpoint

pytestmark = pytest.mark.slow  # spawns processes (deselect with -m 'not slow')

TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' %}{{ raise_exception('this template takes no system message') }}{% endif -%}"
    "{{ m['role'].upper() }}: {% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endif %}{% if not loop.last %} {% endif %}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %} {{ greeting }}{% endif -%}")
QUESTION = [{"role": "user", "content": "What colour is the sky?"}]
PREFILLED = QUESTION + [{"role": "assistant", "content": "The sky is"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("chat-template"))


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "template.jinja"
    path.write_text(TEMPLATE)
    s = ServerProcess(checkpoint, "--served-model-name", "m", "--max-model-len", "256", "--chat-template", str(path),
                      "--default-chat-template-kwargs", '{"greeting": "ANSWER:"}', "--trust-request-chat-template")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def render(checkpoint):
    """transformers' rendering of a conversation (the reference)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)

    def rendered(messages: list[dict], template: str = TEMPLATE, **kwargs) -> str:
        kwargs.setdefault("add_generation_prompt", True)
        return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, **kwargs)
    return rendered


def chat(server: ServerProcess, messages: list[dict], **fields) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/chat/completions", timeout=60, json={
        "model": "m", "messages": messages, "max_tokens": 6, "temperature": 0, **fields})


def same_as_completion(server: ServerProcess, response: httpx.Response, prompt: str) -> None:
    """The chat answer equals the completion of `prompt`: its prompt tokens and greedy tokens."""
    assert response.status_code == 200, response.text
    completion = httpx.post(server.base_url + "/v1/completions", timeout=60, json={
        "model": "m", "prompt": prompt, "max_tokens": 6, "temperature": 0}).json()
    answer = response.json()
    assert answer["usage"]["prompt_tokens"] == completion["usage"]["prompt_tokens"]
    assert answer["choices"][0]["message"]["content"] == completion["choices"][0]["text"]


def test_the_servers_template_and_default_variables_render_the_chat(server, render):
    prompt = render(QUESTION, greeting="ANSWER:")
    assert prompt == "USER: What colour is the sky? ANSWER:"
    same_as_completion(server, chat(server, QUESTION), prompt)


def test_a_requests_variables_override_the_servers(server, render):
    response = chat(server, QUESTION, chat_template_kwargs={"greeting": "REPLY:", "unused": [1, 2]})
    same_as_completion(server, response, render(QUESTION, greeting="REPLY:"))


def test_continue_final_message_ends_the_prompt_inside_the_answer(server, render):
    prompt = render(PREFILLED, add_generation_prompt=False, continue_final_message=True)
    assert prompt.endswith("ASSISTANT: The sky is")
    response = chat(server, PREFILLED, add_generation_prompt=False, continue_final_message=True)
    same_as_completion(server, response, prompt)
    bare = chat(server, QUESTION, add_generation_prompt=False)
    same_as_completion(server, bare, render(QUESTION, add_generation_prompt=False))


def test_echo_puts_the_prefilled_answer_before_its_continuation(server):
    """vLLM's chat `echo`: with the last message the assistant's, the answer starts with its text —
    whole, and streamed as the first content after the role; a user's last message is not echoed."""
    prefill = {"add_generation_prompt": False, "continue_final_message": True}
    plain = chat(server, PREFILLED, **prefill).json()["choices"][0]["message"]["content"]
    echoed = chat(server, PREFILLED, echo=True, **prefill).json()["choices"][0]["message"]["content"]
    assert echoed == "The sky is" + plain
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", timeout=60, json={
            "model": "m", "messages": PREFILLED, "max_tokens": 6, "temperature": 0, "stream": True, "echo": True,
            **prefill}) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    deltas = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]]
    assert deltas[:2] == ["", "The sky is"] and "".join(d or "" for d in deltas) == echoed
    assert chat(server, QUESTION, echo=True).json()["choices"][0]["message"]["content"] == \
        chat(server, QUESTION).json()["choices"][0]["message"]["content"]


def test_a_trusted_requests_own_template(server, render):
    own = "{% for m in messages %}Q: {{ m['content'] }}{% endfor %}{% if add_generation_prompt %} A:{% endif %}"
    same_as_completion(server, chat(server, QUESTION, chat_template=own), render(QUESTION, template=own))


def test_a_template_that_prints_content_as_a_string_gets_the_image_token(server, checkpoint):
    """A text model's template (`{{ m['content'] }}`) is detected and given one string per message,
    the image as `<image>` on its line: the same prompt and answer as a template that loops over
    the parts to print the same text."""
    from helpers.server_process import data_url
    from helpers.tiny_models import make_image

    strings = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    parts = ("{% for m in messages %}{{ m['role'] }}: {% for p in m['content'] %}{% if p['type'] == 'image' %}"
             "<image>\n{% else %}{{ p['text'] }}{% endif %}{% endfor %}{{ '\\n' }}{% endfor %}")  # trim_blocks
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(make_image(5))}},
                                          {"type": "text", "text": "What is this?"}]}]
    one, other = (chat(server, image, chat_template=t).json() for t in (strings, parts))
    assert one["usage"]["prompt_tokens"] == other["usage"]["prompt_tokens"] > 10, (one, other)
    assert one["choices"][0]["message"]["content"] == other["choices"][0]["message"]["content"]


def test_the_responses_api_renders_with_the_servers_template(server):
    response = httpx.post(server.base_url + "/v1/responses", timeout=60, json={
        "model": "m", "input": QUESTION[0]["content"], "max_output_tokens": 6, "temperature": 0})
    assert response.status_code == 200, response.text
    answer = chat(server, QUESTION).json()
    assert response.json()["usage"]["input_tokens"] == answer["usage"]["prompt_tokens"]


@pytest.mark.parametrize("fields, param, words", [
    ({"messages": [{"role": "system", "content": "Be brief."}] + QUESTION}, None, "takes no system message"),
    ({"continue_final_message": True}, "continue_final_message", "cannot both be true"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs", "cannot set"),
    ({"chat_template_kwargs": ["greeting"]}, "chat_template_kwargs", None),
    ({"chat_template": "{% for m in messages %}"}, "chat_template", "syntax error at line 1"),
    ({"messages": PREFILLED, "add_generation_prompt": False, "continue_final_message": True,
      "chat_template": "{% for m in messages if m['role'] == 'user' %}{{ m['content'] }}{% endfor %}"},
     None, "cannot render these messages"),
])
def test_what_the_template_refuses_is_a_400_and_the_server_serves_on(server, render, fields, param, words):
    body = {"messages": QUESTION, **fields}
    response = chat(server, body.pop("messages"), **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and (param is None or error["param"] == param), error
    assert words is None or words in error["message"], error
    same_as_completion(server, chat(server, QUESTION), render(QUESTION, greeting="ANSWER:"))


def test_a_template_that_opens_thinking_turns_reasoning_content_on(checkpoint, tmp_path):
    """A Thinking model's template (its generation prompt opens `<think>`) needs no flag: the
    server says so at start, and a chat answer's text up to `</think>` is its reasoning_content —
    here all of it, a random model never closing the block — equal to the completion's text."""
    model = tmp_path / "thinking"
    shutil.copytree(checkpoint, model)
    (model / "chat_template.jinja").write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                                               "{% endfor %}{% if add_generation_prompt %}assistant: <think>\n"
                                               "{% endif %}")
    server = ServerProcess(str(model), "--served-model-name", "m", "--max-model-len", "256")
    try:
        answer = chat(server, QUESTION).json()["choices"][0]["message"]
        text = httpx.post(server.base_url + "/v1/completions", timeout=60, json={
            "model": "m", "prompt": "user: What colour is the sky?\nassistant: <think>\n", "max_tokens": 6,
            "temperature": 0}).json()["choices"][0]["text"]
        thinking, _, rest = text.partition("</think>")
        assert (answer["reasoning_content"], answer["content"]) == (thinking, rest.lstrip("\n")), (answer, text)
        assert "reasoning_content" in answer and "opens a <think> block" in server.output()
    finally:
        server.stop()
