"""`POST /v1/responses` request body (OpenAI's Responses API, the subset vLLM serves) and its
translation into what the chat path takes: chat messages, chat-style tools and tool_choice.

Input items: a string (one user message), or a list of messages (`{"role", "content"}` with or
without `"type": "message"`; content a string or `input_text` / `input_image` / `output_text`
parts), `function_call` items (an assistant's calls, consecutive ones joined into one turn) and
`function_call_output` items (tool turns). An image is a URL (`data:`, or what the server allows
for chat); a `file_id` or an `input_file` part is a 400: this server keeps no files. `reasoning`
items are skipped (no model here emits them).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mmserve.entrypoints.openai.protocol import ParameterError
from mmserve.entrypoints.openai.sampling_extras import structured_outputs_of
from mmserve.frontend.request.prompt import PromptSettings
from mmserve.sampling_params import SamplingParams
from mmserve.structured_outputs import StructuredOutputsParams


class TextFormat(BaseModel):
    """`text.format`: `{"type": "text" | "json_object" | "json_schema", "name", "schema", "strict"}`."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: Any = Field(default=None, alias="schema")
    strict: bool | None = None

    def to_structured_outputs(self) -> StructuredOutputsParams | None:
        return structured_outputs_of(self.type, self.schema_, "text.format", "a schema")

    def echo(self) -> dict[str, Any]:
        """The format as a response repeats it."""
        out: dict[str, Any] = {"type": self.type}
        if self.type == "json_schema":
            out.update(name=self.name, schema=self.schema_, strict=self.strict)
        return out


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="allow")
    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    """The body: OpenAI's fields this server honours; others are ignored and named in a warning."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    cache_salt: str | None = None  # vLLM's extra, as on chat
    mm_processor_kwargs: dict[str, Any] | None = None
    user: str | None = None
    request_id: str | None = None  # vLLM's: the response's id after "resp_" (X-Request-Id wins)
    priority: int | None = 0  # vLLM's: the lower, the sooner it runs (--scheduling-policy priority)

    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})

    def check_supported(self) -> None:
        """Every field a response honours is checked where it is read (`text.format`, `tools`)."""

    def prompt_settings(self) -> PromptSettings:
        return PromptSettings(self.cache_salt, self.mm_processor_kwargs)

    def structure_param(self) -> str | None:
        return "text.format"

    def to_sampling_params(self, default_max_tokens: int, defaults: dict[str, Any] | None = None) -> SamplingParams:
        """The engine's sampling parameters (ValueError for a bad value); `defaults` fill unset fields."""
        values: dict[str, Any] = {
            "max_tokens": default_max_tokens if self.max_output_tokens is None else self.max_output_tokens,
            "temperature": self.temperature, "top_p": self.top_p}
        if self.text is not None and self.text.format is not None:
            values["structured_outputs"] = self.text.format.to_structured_outputs()
        return SamplingParams(**{**(defaults or {}), **{k: v for k, v in values.items() if v is not None}})

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """`tools` in chat's shape; a non-function tool is a 400."""
        if self.tools is None:
            return None
        out = []
        for i, tool in enumerate(self.tools):
            if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
                raise ParameterError("tools", f"tools[{i}]: only function tools with a name are served here")
            function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
            out.append({"type": "function", "function": function})
        return out

    def chat_tool_choice(self) -> Any:
        """`tool_choice` in chat's shape (`{"type": "function", "name"}` -> chat's nested name)."""
        choice = self.tool_choice
        if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
            return {"type": "function", "function": {"name": choice.get("name")}}
        return choice

    def input_messages(self) -> list[dict[str, Any]]:
        """This request's input as chat messages (without `instructions`)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return input_items_to_messages(self.input)


def input_items_to_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses input items -> chat messages; a `ParameterError` names the first bad item."""
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ParameterError("input", f"{where} must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item.get("role"), "content": _content(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") and not last["content"]:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output, where)
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
        elif kind != "reasoning":
            raise ParameterError("input", f"{where}: input items of type {kind!r} are not supported")
    return messages


def _content(content: Any, where: str) -> Any:
    if isinstance(content, str) or content is None:
        return content
    if not isinstance(content, list):
        raise ParameterError("input", f"{where}.content must be a string or a list of parts")
    return [_part(part, f"{where}.content[{j}]") for j, part in enumerate(content)]


def _part(part: Any, where: str) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in ("input_text", "output_text", "text"):
        return {"type": "text", "text": part.get("text")}
    if kind == "input_image":
        if part.get("file_id") is not None or not isinstance(part.get("image_url"), str):
            raise ParameterError("input", f"{where}: an input_image needs image_url (a data: URL); this server "
                                 "keeps no files, so file_id is not supported", code="unsupported_parameter")
        return {"type": "image_url", "image_url": {"url": part["image_url"]}}
    raise ParameterError("input", f"{where}: content parts of type {kind!r} are not supported (input_text, "
                         "input_image)", code="unsupported_parameter")


def _text_of(output: Any, where: str) -> str:
    """A function_call_output's output given as parts: their text joined."""
    if isinstance(output, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in output):
        return "".join(p["text"] for p in output)
    raise ParameterError("input", f"{where}.output must be a string or a list of text parts")
