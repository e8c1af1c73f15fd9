"""A `vllm serve` command line's spellings, read as vLLM reads them, before argparse sees them.

- **Underscores in a flag's name** (`--max_model_len 4096`): the dashed flag.
- **A JSON flag's keys as flags of their own** (vLLM's recipes: `--limit-mm-per-prompt.video 0`,
  `--mm-processor-kwargs.max_pixels=1003520`, nested as `--kv-events-config.topic kv`): each value
  is read as JSON where it parses (`0`, `true`, `[1, 2]`), else as text; a key ending in `+` adds
  its comma-separated values to a list (`--x.sizes+ 1,2`). Every such key of one flag, over the
  flag's own JSON object when it is given too, becomes that one flag with one JSON object.

A dotted key of a flag that takes no JSON object is a ValueError naming it.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

# vLLM's JSON flags that mmserve takes only to say what it does with them (config/vllm_flags.py)
VLLM_JSON_FLAGS = ("--compilation-config", "--speculative-config", "--kv-transfer-config", "--hf-overrides")


def json_flags(parser: argparse.ArgumentParser) -> set[str]:
    """The flags of `parser` whose value is a JSON object (their `type` is `json.loads` or named `json_object`)."""
    found = {s for a in parser._actions for s in a.option_strings
             if a.type is json.loads or getattr(a.type, "__name__", "") == "json_object"}
    return found | {f for f in VLLM_JSON_FLAGS if f in parser._option_string_actions}


def vllm_argv(argv: list[str], objects: set[str]) -> list[str]:
    """`argv` with vLLM's spellings made mmserve's; `objects`: the flags that take a JSON object."""
    out: list[str] = []
    dotted: dict[str, dict[str, Any]] = {}
    words = iter(argv)
    for word in words:
        if not word.startswith("--") or word == "--":
            out.append(word)
            continue
        key, eq, inline = word.partition("=")
        name, dot, path = key.partition(".")
        name = "--" + name[2:].replace("_", "-")
        if not dot:
            out.append(name + eq + inline)
            continue
        if name not in objects:
            raise ValueError(f"{key}: {name} takes no JSON object, so it has no keys to set")
        text = inline if eq else next(words, None)
        if text is None:
            raise ValueError(f"{key} needs a value")
        _set(dotted.setdefault(name, {}), path, text, key)
    for name, values in dotted.items():
        out = _merged(out, name, values)
    return out


def _set(target: dict[str, Any], path: str, text: str, key: str) -> None:
    """`target[a][b]... = value` for `path` "a.b...", the value read as JSON where it parses."""
    *parents, last = path.split(".")
    if not all(parents) or not last.rstrip("+"):
        raise ValueError(f"{key}: an empty key")
    for part in parents:
        node = target.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"{key}: {part} is set to a value already")
        target = node
    if last.endswith("+"):  # vLLM's list append: --x.sizes+ 1,2
        items = target.setdefault(last[:-1], [])
        if not isinstance(items, list):
            raise ValueError(f"{key}: {last[:-1]} is not a list")
        items.extend(_value(t) for t in text.split(","))
    else:
        target[last] = _value(text)


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _merged(argv: list[str], name: str, values: dict[str, Any]) -> list[str]:
    """`argv` with `name`'s own JSON object (its last, where given) and `values` over it as one flag."""
    base: dict[str, Any] = {}
    out, i = [], 0
    while i < len(argv):
        word = argv[i]
        if word == name and i + 1 < len(argv):
            base, i = _object(argv[i + 1], name), i + 2
            continue
        if word.startswith(name + "="):
            base, i = _object(word[len(name) + 1:], name), i + 1
            continue
        out.append(word)
        i += 1
    return [*out, name, json.dumps(_deep_merge(base, values))]


def _object(text: str, name: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        raise ValueError(f"{name}: not a JSON object: {text!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name}: not a JSON object: {text!r}")
    return value


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in over.items():
        old = merged.get(key)
        merged[key] = _deep_merge(old, value) if isinstance(old, dict) and isinstance(value, dict) else value
    return merged
