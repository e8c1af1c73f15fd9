"""Which chat template renders a conversation, from where a checkpoint publishes it.

A checkpoint publishes its template in one of three places: `chat_template.jinja` (transformers
5's own), `chat_template.json` (`{"chat_template": ...}`, the processor's: what Qwen2.5-VL,
Qwen3-VL and llava-hf publish), or the tokenizer's `tokenizer_config.json` (`"chat_template"`).
The tokenizer reads the first and the last; a processor reads the first two. vLLM's rule
(`resolve_hf_chat_template`) picks between them: the processor's template, unless the request
has tools and the tokenizer has its own (Qwen2.5-VL's tokenizer template is the one that renders
tools); else whichever exists.
"""

from __future__ import annotations

import json
import os


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
    processor's, else the tokenizer's (None: neither; the caller's renderer says so)."""
    if has_tools and tokenizer_template:
        return tokenizer_template
    return processor_template or tokenizer_template
