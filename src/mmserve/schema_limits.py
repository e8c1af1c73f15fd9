"""Bounds on a structured-output schema, checked in P0 before any grammar is built.

Compiling a grammar costs time and memory that grow with the schema (an enum's values, an
object's optional properties, nesting), and a compiled grammar is held by every engine rank, so
a schema is refused with a `SchemaError` (a 400) past these limits, before it reaches the engine:

- `MAX_SCHEMA_DEPTH`: JSON nesting of the schema (as text or as an object), like the body's;
- `MAX_ENUM_VALUES`: `enum` values, all enums of the schema together;
- `MAX_PROPERTIES`: `properties` entries, all objects together;
- `MAX_OPTIONAL_PROPERTIES`: properties not in `required` of one object (the costliest to compile).

A schema no value satisfies (a `$ref` chain that never reaches a type, a required property that
is `false`) is refused too: its grammar would mask every token.
"""

from __future__ import annotations

from typing import Any

from mmserve.errors import SchemaError

MAX_SCHEMA_DEPTH = 64
MAX_ENUM_VALUES = 1024
MAX_PROPERTIES = 1024
MAX_OPTIONAL_PROPERTIES = 128
MAX_GRAMMAR_CHARS = 64 << 10  # a regex's or an EBNF grammar's text
MAX_CHOICES = MAX_ENUM_VALUES  # `choice` strings
MAX_CHOICE_CHARS = 64 << 10  # all `choice` strings together


def check_grammar_text(name: str, text: object) -> None:
    """A `SchemaError` unless `text` is a non-empty string of at most `MAX_GRAMMAR_CHARS`."""
    if not isinstance(text, str) or not text:
        raise SchemaError(f"structured outputs' {name} must be a non-empty string")
    if len(text) > MAX_GRAMMAR_CHARS:
        raise SchemaError(f"structured outputs' {name} has {len(text)} characters; the limit is {MAX_GRAMMAR_CHARS}")


def check_choices(choices: object) -> None:
    """A `SchemaError` unless `choices` is 1 to `MAX_CHOICES` non-empty strings, `MAX_CHOICE_CHARS` in all."""
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise SchemaError("structured outputs' choice must be a non-empty list of non-empty strings")
    if len(choices) > MAX_CHOICES or sum(map(len, choices)) > MAX_CHOICE_CHARS:
        raise SchemaError(f"structured outputs' choice is limited to {MAX_CHOICES} strings of "
                          f"{MAX_CHOICE_CHARS} characters in all")


def text_depth(text: str) -> int:
    """The deepest bracket nesting of JSON text (brackets inside strings not counted)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def check_text_depth(text: str) -> None:
    """A `SchemaError` for schema text nested deeper than `MAX_SCHEMA_DEPTH`."""
    if text_depth(text) > MAX_SCHEMA_DEPTH:
        raise SchemaError(f"the JSON schema is nested more than {MAX_SCHEMA_DEPTH} levels deep")


def check_schema_size(schema: Any) -> None:
    """A `SchemaError` naming the first limit `schema` (parsed JSON) goes past; iterative."""
    enums = properties = 0
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise SchemaError(f"the JSON schema is nested more than {MAX_SCHEMA_DEPTH} levels deep")
        if isinstance(node, dict):
            if isinstance(node.get("enum"), list):
                enums += len(node["enum"])
            props = node.get("properties")
            if isinstance(props, dict):
                properties += len(props)
                _check_optional(props, node.get("required"))
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
    if enums > MAX_ENUM_VALUES:
        raise SchemaError(f"the JSON schema has {enums} enum values; the limit is {MAX_ENUM_VALUES}")
    if properties > MAX_PROPERTIES:
        raise SchemaError(f"the JSON schema has {properties} properties; the limit is {MAX_PROPERTIES}")


def _check_optional(props: dict[str, Any], required: Any) -> None:
    needed = set(required) if isinstance(required, list) else set()
    optional = sum(1 for name in props if name not in needed)
    if optional > MAX_OPTIONAL_PROPERTIES:
        raise SchemaError(f"an object of the JSON schema has {optional} optional properties; the limit is "
                          f"{MAX_OPTIONAL_PROPERTIES}")


def check_satisfiable(schema: dict[str, Any]) -> None:
    """A `SchemaError` when no JSON value satisfies `schema` (its grammar would be empty)."""
    if not _productive(schema, schema, frozenset()):
        raise SchemaError("the JSON schema admits no value (a $ref cycle or a required part that is false)")


def _productive(node: Any, root: dict[str, Any], visiting: frozenset[int]) -> bool:
    """Whether some finite JSON value satisfies `node` (conservative: unknown shapes say yes)."""
    if isinstance(node, bool):
        return node
    if not isinstance(node, dict) or id(node) in visiting:
        return not isinstance(node, dict)  # a cycle back to a node being proven yields nothing finite
    visiting = visiting | {id(node)}
    ref = node.get("$ref")
    if isinstance(ref, str):
        target = _resolve(ref, root)
        if target is not None and not _productive(target, root, visiting):
            return False
    if isinstance(node.get("allOf"), list) and not all(_productive(s, root, visiting) for s in node["allOf"]):
        return False
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list) and not any(_productive(s, root, visiting) for s in node[key]):
            return False
    if isinstance(node.get("enum"), list) and not node["enum"]:
        return False
    found = node.get("properties")
    props: dict[str, Any] = found if isinstance(found, dict) else {}
    listed = node.get("required")
    required: list[Any] = listed if isinstance(listed, list) else []
    for name in required:
        if name in props and not _productive(props[name], root, visiting):
            return False
    items = node.get("items")
    min_items = node.get("minItems", 0)
    if isinstance(min_items, int) and min_items > 0 and items is not None:
        return _productive(items, root, visiting)
    return True


def _resolve(ref: str, root: dict[str, Any]) -> Any:
    """The local schema `ref` (`#` or `#/a/b`) points at; None for one we cannot follow."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node: Any = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node
