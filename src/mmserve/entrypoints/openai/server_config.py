"""The HTTP server's settings (`mmserve serve`'s own flags), in config.py's style.

Each field's `metadata["help"]` is its flag's help; `--snake-case` of the field name is the flag.
The engine's flags come from `mmserve.config.add_cli_args`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass, field, fields
from typing import Any

from mmserve.config import check_finite
from mmserve.entrypoints.openai.reasoning import PARSERS as REASONING_PARSERS
from mmserve.entrypoints.openai.user_middleware import load_middleware
from mmserve.errors import ClientError
from mmserve.multimodal.chat_templates import CONTENT_FORMATS, ChatTemplatePolicy, load_chat_template

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


@dataclass(frozen=True)
class ServerConfig:
    host: str = field(default="127.0.0.1", metadata={
        "help": "Address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 for every interface)."})
    port: int = field(default=8000, metadata={"help": "TCP port to listen on (0: any free port)."})
    served_model_name: tuple[str, ...] | None = field(default=None, metadata={
        "help": "Name(s) clients use in 'model' (default: the model argument); the first is the default.",
        "nargs": "+"})
    api_key: str | None = field(default=None, metadata={
        "help": "Require 'Authorization: Bearer KEY' on /v1 routes (/health and /metrics stay open); default: the "
                "VLLM_API_KEY environment variable, as vLLM reads it."})
    log_level: str = field(default="info", metadata={"help": "Server log level.", "choices": LOG_LEVELS})
    disable_log_stats: bool = field(default=False, metadata={
        "help": "Log no periodic stats line (vLLM's flag; /metrics counts as before).", "action": "store_true"})
    enable_auto_tool_choice: bool = field(default=False, metadata={
        "help": 'Let requests use tool_choice "auto" (the default when tools are given) with --tool-call-parser '
                "(vLLM's flag; without it, auto is on wherever the model family's format is known).",
        "action": "store_true"})
    tool_call_parser: str | None = field(default=None, metadata={
        "help": "How calls are read from free answers for tool_choice auto: hermes (<tool_call> JSON). Default: "
                "the model family's format (hermes for Qwen2.5-VL and Qwen3-VL; none known for LLaVA).",
        "choices": ("hermes",)})
    reasoning_parser: str | None = field(default=None, metadata={
        "help": "Answer a reasoning model's <think>...</think> as the message's reasoning_content, apart from its "
                "content (vLLM's flag; qwen3 and deepseek_r1 read the same tags). Default: on (qwen3) for a "
                "checkpoint whose chat template opens the thinking block itself (Qwen3-VL-Thinking), off otherwise.",
        "choices": REASONING_PARSERS})
    responses_store_mb: float = field(default=256.0, metadata={
        "help": "Memory for finished /v1/responses kept for previous_response_id, in MiB for the node (one store "
                "for every API server; least recently used evicted first; 0 keeps none)."})
    max_request_body_mb: float | None = field(default=None, metadata={
        "help": "Largest request body in MiB, refused with 413 before it is buffered (default: room for "
                "--limit-mm-per-prompt images of --max-media-bytes as base64, plus 1 MiB)."})
    chat_template: str | None = field(default=None, metadata={
        "help": "A Jinja chat template, or a file holding one, used instead of the checkpoint's (vLLM's flag); "
                "checked when the server starts."})
    trust_request_chat_template: bool = field(default=False, metadata={
        "help": "Let a chat request bring its own chat_template (a Jinja template run in a sandbox; refused "
                "with 400 without this flag, as in vLLM).", "action": "store_true"})
    default_chat_template_kwargs: dict[str, Any] | None = field(default=None, metadata={
        "help": "Template variables for every chat request, as a JSON object (e.g. '{\"add_vision_id\": true}'); "
                "a request's chat_template_kwargs override them."})
    chat_template_content_format: str = field(default="auto", metadata={
        "help": "How a message's content reaches the chat template: 'openai', its list of parts; 'string', one "
                "string (text parts one per line, an image as the model's image token); 'auto' (default) "
                "whichever the template reads (vLLM's flag).", "choices": CONTENT_FORMATS})
    ssl_keyfile: str | None = field(default=None, metadata={
        "help": "Serve HTTPS with this private key file (PEM; with --ssl-certfile; vLLM's flag)."})
    ssl_certfile: str | None = field(default=None, metadata={
        "help": "Serve HTTPS with this certificate chain file (PEM; with --ssl-keyfile; vLLM's flag)."})
    root_path: str | None = field(default=None, metadata={
        "help": "The path prefix a proxy serves this server under and strips (ASGI root_path; vLLM's flag)."})
    allowed_origins: list[str] | None = field(default=None, metadata={
        "help": "Answer browsers' cross-origin requests from these origins, a JSON list (e.g. '[\"*\"]'; "
                "default: none, no CORS headers; vLLM's flag, whose default is every origin)."})
    allowed_methods: list[str] | None = field(default=None, metadata={
        "help": "With --allowed-origins, the methods allowed, a JSON list (default '[\"*\"]')."})
    allowed_headers: list[str] | None = field(default=None, metadata={
        "help": "With --allowed-origins, the request headers allowed, a JSON list (default '[\"*\"]')."})
    allow_credentials: bool = field(default=False, metadata={
        "help": "With --allowed-origins, allow credentials (cookies, Authorization) in cross-origin requests.",
        "action": "store_true"})
    return_tokens_as_token_ids: bool = field(default=False, metadata={
        "help": "Name each token of an answer's log probabilities 'token_id:N' instead of by its text (vLLM's flag; "
                "a request's return_tokens_as_token_ids overrides it).", "action": "store_true"})
    enable_force_include_usage: bool = field(default=False, metadata={
        "help": "End every stream with a usage chunk, as if it asked for stream_options.include_usage (vLLM's flag).",
        "action": "store_true"})
    enable_request_id_headers: bool = field(default=False, metadata={
        "help": "Every answer carries X-Request-Id: the client's (its X-Request-Id header or body request_id), "
                "else the answer's id (vLLM's flag).", "action": "store_true"})
    middleware: list[str] | None = field(default=None, metadata={
        "help": "An ASGI middleware of your own, by import path (package.module.name): a class is added with "
                "app.add_middleware, an async function (request, call_next) as an HTTP middleware; repeatable; "
                "imported when the server starts (vLLM's flag).", "action": "append"})
    disable_fastapi_docs: bool = field(default=False, metadata={
        "help": "Serve no OpenAPI schema (/openapi.json) and no Swagger or ReDoc pages (/docs, /redoc) (vLLM's flag).",
        "action": "store_true"})
    request_read_timeout_s: float = field(default=30.0, metadata={
        "help": "Seconds a connection has to send a whole request (headers and body) once it opens or a "
                "request begins; slower ones are closed (idle keep-alive connections close after 5 s)."})

    def __post_init__(self) -> None:
        check_finite(self)
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535]; got {self.port}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}; got {self.log_level!r}")
        if self.served_model_name is not None:
            names = tuple(self.served_model_name)
            if not names or not all(isinstance(n, str) and n for n in names):
                raise ValueError("served_model_name must be one or more non-empty names")
            object.__setattr__(self, "served_model_name", names)
        if self.max_request_body_mb is not None and self.max_request_body_mb <= 0:
            raise ValueError(f"max_request_body_mb must be positive; got {self.max_request_body_mb}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        if self.request_read_timeout_s <= 0:
            raise ValueError(f"request_read_timeout_s must be positive; got {self.request_read_timeout_s}")
        if self.responses_store_mb < 0:
            raise ValueError(f"responses_store_mb must not be negative; got {self.responses_store_mb}")
        self.chat_template_policy()  # a missing file, a syntax error or a reserved variable stops the start
        if self.api_key == "":
            raise ValueError("api_key must not be empty (leave it unset for no key)")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("--ssl-keyfile and --ssl-certfile go together")
        for name in ("ssl_keyfile", "ssl_certfile"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"--{name.replace('_', '-')} {path!r} is not a file")
        for path in self.middleware or ():
            load_middleware(path)  # a wrong path stops the start, before the engine loads
        if self.allowed_origins is None and (self.allowed_methods or self.allowed_headers or self.allow_credentials):
            raise ValueError("--allowed-methods, --allowed-headers and --allow-credentials need --allowed-origins")

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_certfile is not None else "http"

    def cors(self) -> dict[str, Any] | None:
        """CORSMiddleware's arguments, or None: no cross-origin headers."""
        if self.allowed_origins is None:
            return None
        return {"allow_origins": self.allowed_origins, "allow_methods": self.allowed_methods or ["*"],
                "allow_headers": self.allowed_headers or ["*"], "allow_credentials": self.allow_credentials}

    def uvicorn_args(self) -> dict[str, Any]:
        """TLS and root path, as uvicorn.Config takes them."""
        return {"ssl_keyfile": self.ssl_keyfile, "ssl_certfile": self.ssl_certfile, "root_path": self.root_path or ""}

    def served_model_names(self, model: str) -> list[str]:
        """The names the server answers to: the configured ones, else `model`."""
        return list(self.served_model_name) if self.served_model_name else [model]

    def auto_tool_parser(self, family_parser: str | None = None) -> str | None:
        """The parser for tool_choice "auto": `--tool-call-parser` when given, else the model
        family's (`deployment_defaults.family_tool_parser`); None where "auto" is refused."""
        return self.tool_call_parser or family_parser

    def chat_template_policy(self) -> ChatTemplatePolicy:
        """The chat template settings requests are rendered under (`--chat-template` read here)."""
        try:
            template = None if self.chat_template is None else load_chat_template(self.chat_template)
            return ChatTemplatePolicy(template, self.trust_request_chat_template,
                                      self.default_chat_template_kwargs or {}, self.chat_template_content_format)
        except ClientError as exc:  # the policy's checks speak to requests; here it is a flag
            flag = str(exc).replace("default_chat_template_kwargs", "--default-chat-template-kwargs")
            raise ValueError(flag) from None

    @classmethod
    def from_cli(cls, ns: argparse.Namespace) -> ServerConfig:
        """The flags' config; without `--api-key`, the key of the environment's `VLLM_API_KEY` (as vLLM
        reads it: a vLLM deployment that sets it is not left open here)."""
        values = {f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)}
        if values.get("api_key") is None and os.environ.get("VLLM_API_KEY"):
            values["api_key"] = os.environ["VLLM_API_KEY"]
        return cls(**values)


def add_server_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add one flag per `ServerConfig` field (`--served-model-name`, ...)."""
    for f in fields(ServerConfig):
        default = f.default if f.default is not dataclasses.MISSING else None
        kw: dict[str, Any] = {"default": default, "help": f.metadata["help"], "dest": f.name}
        if f.name == "port":
            kw["type"] = int
        if f.name in ("max_request_body_mb", "responses_store_mb", "request_read_timeout_s"):
            kw["type"] = float
        if f.name == "default_chat_template_kwargs":
            kw["type"] = json_object
        if f.name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            kw["type"] = json_strings
        if f.metadata.get("action"):
            kw = {k: v for k, v in kw.items() if k != "type"} | {"action": f.metadata["action"]}
        for key in ("nargs", "choices"):
            if key in f.metadata:
                kw[key] = f.metadata[key]
        parser.add_argument("--" + f.name.replace("_", "-"), **kw)


def json_strings(text: str) -> list[str]:
    """A flag's JSON list of strings (argparse names the flag when this raises)."""
    value = _json_flag(text)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f'must be a JSON list of strings, e.g. \'["*"]\'; got {text!r:.80}')
    return value


def json_object(text: str) -> dict[str, Any]:
    """A flag's JSON object (argparse names the flag when this raises)."""
    value = _json_flag(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, e.g. '{{\"add_vision_id\": true}}'; got {text!r:.80}")
    return value


def _json_flag(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {text!r:.80}") from None
