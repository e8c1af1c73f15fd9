"""What a structured-output request asks for, checked and normalised in P0 (no heavy imports).

Five kinds, vLLM's: a JSON schema (`json`), any JSON object (`json_object`), a regular expression
(`regex`, xgrammar's flavour: ECMAScript-like), one of a list of strings (`choice`) and an EBNF
grammar (`grammar`, xgrammar's / llama.cpp's GBNF dialect with a `root` rule).

`StructuredOutputsParams` crosses to the engine inside `SamplingParams`; its `key` (kind and the
canonical schema text) names the compiled grammar the workers cache (worker/grammar.py). Nothing
here reaches a cache key of the prompt: the prefix and encoder caches never see it.

With a reasoning parser the server sets `after_thinking` (the `<think>` and `</think>` token ids):
the grammar then binds the answer only, after the model's thinking block, as vLLM's reasoning
parsers do (the runner's `ThinkingGate`). A template that opened the block leaves the thinking free
until `</think>`; otherwise the first token may open one or begin the answer.

Outputs are compact JSON (no whitespace between tokens, separators "," and ":"), so a weak or
random model cannot spend its budget on spaces; an `integer` or `number` without bounds gets
JSON's safe range (±(2**53 - 1): at most 16 digits, and xgrammar then allows at most 6 decimals),
so it cannot spend it on digits either. Schema keywords the
grammar cannot enforce are refused by name (`unsupported_schema_keyword`) rather than ignored.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import msgspec

from mmserve.errors import ClientError, SchemaError
from mmserve.schema_limits import (check_choices, check_grammar_text, check_satisfiable, check_schema_size,
                                   check_text_depth)

MAX_SAFE_INTEGER = 2**53 - 1
SEPARATORS = (",", ":")  # compact JSON, as clients parse best

# JSON-schema keywords the grammar would silently ignore: a schema using one is refused
_UNSUPPORTED = ("not", "if", "then", "else", "patternProperties", "propertyNames", "dependentRequired",
                "dependentSchemas", "dependencies", "unevaluatedProperties", "unevaluatedItems", "contains",
                "minContains", "maxContains", "uniqueItems", "$dynamicRef", "$recursiveRef")
# keywords whose value is a schema, or a list / map of schemas, to walk into
_SUBSCHEMA = ("items", "additionalProperties", "prefixItems", "anyOf", "oneOf", "allOf", "properties",
              "$defs", "definitions")


class StructuredOutputsParams(msgspec.Struct, kw_only=True, frozen=True):
    """Exactly one kind. `json_object`: any JSON object. `json`: a JSON schema as canonical JSON
    text (use `for_schema` to build one from a dict: it is checked and normalised there). `regex`:
    the whole output matches it. `choice`: the output is one of these strings. `grammar`: an EBNF
    grammar whose `root` rule the output derives. Sizes are bounded here (`schema_limits.py`);
    whether xgrammar can build the grammar is `check_structure`'s (P0, before the engine).
    `after_thinking` (not part of `key`): the grammar binds after the thinking block (above)."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    after_thinking: tuple[int, int] | None = None  # (<think>, </think>) ids: bind only after thinking

    def __post_init__(self) -> None:
        given = [self.json is not None, self.json_object, self.regex is not None, self.choice is not None,
                 self.grammar is not None]
        if sum(given) != 1:
            raise ClientError("structured outputs take exactly one of json, json_object, regex, choice or grammar")
        for name in ("regex", "grammar"):
            text = getattr(self, name)
            if text is not None:
                check_grammar_text(name, text)
        if self.choice is not None:
            check_choices(self.choice)

    @property
    def is_json(self) -> bool:
        """A JSON kind: its output is compact JSON, which never holds a raw control character."""
        return self.json is not None or self.json_object

    @classmethod
    def for_schema(cls, schema: Any) -> StructuredOutputsParams:
        """A schema (dict, or JSON text) checked for what the grammar supports, its size
        (schema_limits.py) and its satisfiability, and normalised; a `SchemaError` if not."""
        if isinstance(schema, str):
            check_text_depth(schema)
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise SchemaError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise SchemaError("a JSON schema must be an object")
        check_schema_size(schema)
        normalised = normalise_schema(schema)
        check_satisfiable(normalised)
        return cls(json=json.dumps(normalised, separators=SEPARATORS))  # property order kept

    @property
    def key(self) -> str:
        """What the compiled grammar is cached under."""
        if self.json_object:
            return "json_object"
        if self.regex is not None:
            return "regex:" + self.regex
        if self.choice is not None:
            return "choice:" + json.dumps(self.choice, ensure_ascii=False)
        if self.grammar is not None:
            return "grammar:" + self.grammar
        return "schema:" + (self.json or "")


def choice_ebnf(choices: list[str]) -> str:
    """The EBNF grammar of "exactly one of `choices`" (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def normalise_schema(schema: dict[str, Any], path: str = "$") -> dict[str, Any]:
    """A copy of `schema` with bounded integers; a SchemaError naming the first unsupported keyword."""
    for key in _UNSUPPORTED:
        if key in schema:
            raise SchemaError(f"unsupported_schema_keyword: {key!r} at {path} is not supported in "
                             f"structured outputs (the grammar cannot enforce it)")
    out = dict(schema)
    if _types(schema) in ({"integer"}, {"number"}):
        if "minimum" not in schema and "exclusiveMinimum" not in schema:
            out["minimum"] = -MAX_SAFE_INTEGER
        if "maximum" not in schema and "exclusiveMaximum" not in schema:
            out["maximum"] = MAX_SAFE_INTEGER
    for key in _SUBSCHEMA:
        value = schema.get(key)
        if isinstance(value, dict) and key in ("properties", "$defs", "definitions"):
            out[key] = {name: _walk(sub, f"{path}.{key}.{name}") for name, sub in value.items()}
        elif isinstance(value, dict):
            out[key] = _walk(value, f"{path}.{key}")
        elif isinstance(value, list):
            out[key] = [_walk(sub, f"{path}.{key}[{i}]") for i, sub in enumerate(value)]
    return out


def _walk(sub: Any, path: str) -> Any:
    if isinstance(sub, bool):
        return sub
    if not isinstance(sub, dict):
        raise SchemaError(f"invalid JSON schema: {path} must be a schema (an object or a boolean)")
    return normalise_schema(sub, path)


def _types(schema: dict[str, Any]) -> set[str]:
    kind = schema.get("type")
    return {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else set()


def check_structure(spec: StructuredOutputsParams) -> None:
    """P0's check that xgrammar can build the grammar (no tokenizer needed): a SchemaError naming
    the problem for a malformed or unsupported schema, regex or grammar. The HTTP layer checks as
    it parses (to name the field) and the input processor again: the verdict is cached by key."""
    if not spec.json_object:
        problem = _problem(spec.key)
        if problem is not None:
            raise SchemaError(problem)


@functools.lru_cache(maxsize=256)
def _problem(key: str) -> str | None:
    """What xgrammar says against the structure named by `key` (`StructuredOutputsParams.key`), or None."""
    import xgrammar as xgr

    kind, _, text = key.partition(":")
    what = {"schema": "JSON schema", "regex": "regex"}.get(kind, "grammar")
    try:
        if kind == "schema":
            xgr.Grammar.from_json_schema(text, any_whitespace=False, separators=SEPARATORS, strict_mode=True)
        elif kind == "regex":
            xgr.Grammar.from_regex(text)
        else:
            xgr.Grammar.from_ebnf(text if kind == "grammar" else choice_ebnf(json.loads(text)))
    except Exception as e:  # xgrammar raises RuntimeError with the converter's message
        message = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        return f"invalid or unsupported {what}: {message.split('] ')[-1]}"
    return None
