"""Chat templates: which one renders a conversation, with what options, and how it fails.

A checkpoint publishes its template in one of three places: `chat_template.jinja` (transformers
5's own), `chat_template.json` (`{"chat_template": ...}`, the processor's: what Qwen2.5-VL,
Qwen3-VL and llava-hf publish), or the tokenizer's `tokenizer_config.json` (`"chat_template"`).
The tokenizer reads the first and the last; a processor reads the first two. vLLM's rule
(`resolve_hf_chat_template`) picks between them: a template the server or the request gives,
else the processor's, unless the request has tools and the tokenizer has its own (Qwen2.5-VL's
tokenizer template is the one that renders tools); else whichever exists.

`ChatTemplateOptions` are vLLM's per-request controls (`add_generation_prompt`,
`continue_final_message`, `chat_template_kwargs`, a request's own `chat_template`); `render_chat`
applies them through transformers' renderer, so the text equals `apply_chat_template`'s. Whatever
the conversation does wrong in a template (a `raise_exception`, a final message to continue that
the template drops, no template at all) is a `ClientError`: a 400, never a 500.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from mmserve.errors import ClientError

# what `apply_chat_template` sets itself: never a template variable a client may set
RESERVED_KWARGS = frozenset({
    "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "return_dict", "return_tensors", "return_assistant_tokens_mask",
    "padding", "truncation", "max_length", "processor_kwargs", "tokenizer_kwargs", "sanitize_control_tokens"})
JINJA_MARKS = ("{{", "{%", "{#", "\n")  # a template literal, not a file name
CONTENT_FORMATS = ("auto", "string", "openai")
NO_TEMPLATE = ("the model has no chat template (its checkpoint publishes none): start the server with "
               "--chat-template, or send a prompt to /v1/completions")


@dataclass(frozen=True)
class ChatTemplateOptions:
    """How one conversation is rendered (vLLM's chat request fields).

    `template`: a Jinja template used instead of the checkpoint's (the server's `--chat-template`,
    or a request's own where the server trusts them). `add_generation_prompt`: end with the header
    of the assistant's reply. `continue_final_message`: end inside the last message, so the model
    continues it (a prefilled answer); the two exclude each other. `kwargs`: extra template
    variables (`chat_template_kwargs`, e.g. Qwen-VL's `add_vision_id`); ones the template never
    reads are ignored. `content_format` (vLLM's `--chat-template-content-format`): "openai" hands
    the template each message's content parts, "string" one string per message (`as_strings`),
    "auto" whichever the template reads (`content_format`). A bad combination raises `ClientError`
    naming the field."""

    template: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    content_format: str = "auto"  # how a message's content parts reach the template: CONTENT_FORMATS

    def __post_init__(self) -> None:
        check_content_format(self.content_format)
        if self.add_generation_prompt and self.continue_final_message:
            raise ClientError("continue_final_message and add_generation_prompt cannot both be true: set "
                              "add_generation_prompt to false to continue the final message",
                              param="continue_final_message")
        check_template_kwargs(self.kwargs, "chat_template_kwargs")


@dataclass(frozen=True)
class ChatTemplatePolicy:
    """What callers may choose about the template: the server's flags (`--chat-template`,
    `--trust-request-chat-template`, `--default-chat-template-kwargs`), or the offline API's
    (which trusts its caller's templates)."""

    template: str | None = None  # loaded (`load_chat_template`); None: the checkpoint's
    trust_request_templates: bool = False
    default_kwargs: Mapping[str, Any] = field(default_factory=dict)
    content_format: str = "auto"

    def __post_init__(self) -> None:
        check_content_format(self.content_format)
        if self.template is not None:
            check_template_syntax(self.template)
        check_template_kwargs(self.default_kwargs, "default_chat_template_kwargs")

    def options(self, template: str | None = None, kwargs: Mapping[str, Any] | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False) -> ChatTemplateOptions:
        """A request's options: its own `template` (refused unless trusted) over the server's, its
        `kwargs` over the server's defaults; ClientError naming the field at fault."""
        if template is not None:
            if not template:
                raise ClientError("chat_template must not be empty (leave it out for the server's)",
                                  param="chat_template")
            if not self.trust_request_templates:
                raise ClientError("this server does not take a request's chat_template (start it with "
                                  "--trust-request-chat-template to allow it)", param="chat_template")
            try:
                check_template_syntax(template)
            except ValueError as exc:
                raise ClientError(str(exc), param="chat_template") from None
        own = check_template_kwargs(kwargs if kwargs is not None else {}, "chat_template_kwargs")
        return ChatTemplateOptions(template or self.template, add_generation_prompt, continue_final_message,
                                   {**self.default_kwargs, **own}, self.content_format)


def check_content_format(value: str) -> None:
    if value not in CONTENT_FORMATS:
        raise ValueError(f"chat template content format must be one of {', '.join(CONTENT_FORMATS)}; got {value!r}")


def check_template_kwargs(kwargs: object, where: str) -> Mapping[str, Any]:
    """`kwargs` as template variables: an object of names, none that `apply_chat_template` sets."""
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise ClientError(f"{where} must be an object of template variables", param=where)
    reserved = sorted(RESERVED_KWARGS.intersection(kwargs))
    if reserved:
        raise ClientError(f"{where} cannot set {', '.join(reserved)}: the renderer sets them (a request's "
                          "add_generation_prompt and continue_final_message are fields of their own)", param=where)
    return kwargs


def load_chat_template(value: str) -> str:
    """`--chat-template`'s value as a template: a file's text when it names a file, else the
    template itself when it looks like one; ValueError for a missing file or a syntax error."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            template = f.read()
    elif any(mark in value for mark in JINJA_MARKS):
        template = value
    else:
        raise ValueError(f"chat template {value!r:.120} is neither a file nor a Jinja template")
    check_template_syntax(template)
    return template


@functools.lru_cache(maxsize=64)
def check_template_syntax(template: str) -> None:
    """ValueError naming the line of a template's syntax error (cached: a client resends its template)."""
    _template_variables(template)


@functools.lru_cache(maxsize=64)
def _template_variables(template: str) -> frozenset[str]:
    """The variables a template reads (jinja2's `find_undeclared_variables`), for filtering kwargs."""
    import jinja2
    from jinja2 import meta

    try:
        return frozenset(meta.find_undeclared_variables(_environment().parse(template)))
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"the chat template has a syntax error at line {exc.lineno}: {exc.message}") from None


@functools.cache
def _environment() -> Any:
    """A parser for templates as transformers compiles them: loop controls (`{% break %}`) and its
    `{% generation %}` block tag."""
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    return ImmutableSandboxedEnvironment(extensions=[GenerationTag, "jinja2.ext.loopcontrols"])


@functools.lru_cache(maxsize=64)
def content_format(template: str) -> str:
    """"openai" when the template loops over a message's content (`{% for p in m['content'] %}`,
    directly or through a `{% set %}` name), else "string": vLLM's detection, on the template's syntax tree."""
    from jinja2 import nodes

    tree = _environment().parse(template)
    content_names = {node.target.name for node in tree.find_all(nodes.Assign)
                     if isinstance(node.target, nodes.Name) and _reads_content(node.node)}

    def over_content(expr: Any) -> bool:
        while isinstance(expr, (nodes.Filter, nodes.Test)) and expr.node is not None:
            expr = expr.node  # `m['content'] | selectattr(...)`
        return _reads_content(expr) or (isinstance(expr, nodes.Name) and expr.name in content_names)

    return "openai" if any(over_content(loop.iter) for loop in tree.find_all(nodes.For)) else "string"


def _reads_content(expr: Any) -> bool:
    from jinja2 import nodes

    if isinstance(expr, nodes.Getitem):
        return isinstance(expr.arg, nodes.Const) and expr.arg.value == "content"
    return isinstance(expr, nodes.Getattr) and expr.attr == "content"


def as_strings(conversation: list[dict], placeholders: Mapping[str, str]) -> list[dict]:
    """The conversation for a template that prints content as a string: each message's parts joined,
    one per line, an image or video part as the model's placeholder text (`placeholders[type]`)."""
    out = []
    for message in conversation:
        content = message.get("content")
        if isinstance(content, list):
            kinds = {part["type"] for part in content} - {"text"} - set(placeholders)
            if kinds:
                raise ClientError(f"this model takes no {kinds.pop()} input")
            text = "\n".join(part["text"] if part["type"] == "text" else placeholders[part["type"]]
                             for part in content)
            message = {**message, "content": text}
        out.append(message)
    return out


def processor_chat_template(model_path: str) -> str | None:
    """The template a checkpoint publishes for its processor: `chat_template.jinja`, else
    `chat_template.json`'s (transformers' `ProcessorMixin` order); None if it publishes neither."""
    jinja = os.path.join(model_path, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read()
    path = os.path.join(model_path, "chat_template.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            template = json.load(f).get("chat_template")
        return template if isinstance(template, str) else None
    return None


def pick_chat_template(processor_template: str | None, tokenizer_template: str | None,
                       has_tools: bool) -> str | None:
    """vLLM's choice: the tokenizer's template for a request with tools when it has one, else the
    processor's, else the tokenizer's (None: neither; `render_chat` says so)."""
    if has_tools and tokenizer_template:
        return tokenizer_template
    return processor_template or tokenizer_template


def render_with_tokenizer(tokenizer: Any, processor_template: str | None, conversation: list[dict],
                          tools: list[dict] | None, options: ChatTemplateOptions | None,
                          placeholders: Mapping[str, str]) -> str:
    """`conversation` rendered by the tokenizer's renderer with `options.template`, else the template
    `pick_chat_template` picks between the processor's (`processor_chat_template`) and the tokenizer's
    own; ending as `options` say (default: with the reply prompt); ClientError for what it refuses."""
    options = options or ChatTemplateOptions()
    own = tokenizer.chat_template
    template = options.template or pick_chat_template(processor_template, own if isinstance(own, str) else None,
                                                      bool(tools))
    return render_chat(tokenizer.apply_chat_template, template, conversation, tools, options, placeholders)


def render_chat(apply: Callable[..., Any], template: str | None, conversation: list[dict],
                tools: list[dict] | None, options: ChatTemplateOptions, placeholders: Mapping[str, str]) -> str:
    """`conversation` rendered by `apply` (a tokenizer's or processor's `apply_chat_template`) with
    `template` (None: the checkpoint has none) and `options`, media as `placeholders` for a template
    that reads strings; ClientError for what the template refuses."""
    if template is None:
        raise ClientError(NO_TEMPLATE)
    try:
        variables = _template_variables(template)
    except ValueError as exc:  # a request's own template (the server's was checked at start)
        raise ClientError(str(exc), param="chat_template") from None
    fmt = content_format(template) if options.content_format == "auto" else options.content_format
    if fmt == "string":
        conversation = as_strings(conversation, placeholders)
    kwargs = {k: v for k, v in options.kwargs.items() if k in variables}  # transformers warns about others
    import jinja2

    try:
        return apply(conversation, tools=tools, chat_template=template, tokenize=False,
                     add_generation_prompt=options.add_generation_prompt,
                     continue_final_message=options.continue_final_message, **kwargs)
    except jinja2.TemplateError as exc:  # raise_exception(...) in the template, or an undefined it needs
        raise ClientError(f"the chat template cannot render these messages: {exc}") from None
    except (ValueError, TypeError) as exc:  # a final message to continue that it drops; content it cannot add
        raise ClientError(f"the chat template cannot render these messages: {exc}") from None
