"""Schemas are bounded before any grammar is built: too deep (as text too), too many enum values or
properties, or satisfied by no value, each a SchemaError (a ClientError, a 400) in P0; the compiled
grammar cache is bounded by bytes."""

from __future__ import annotations

import json

import pytest

from mmserve.errors import ClientError, SchemaError
from mmserve.schema_limits import MAX_ENUM_VALUES, MAX_OPTIONAL_PROPERTIES, MAX_SCHEMA_DEPTH
from mmserve.structured_outputs import StructuredOutputsParams


def nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "array", "items": {"anyOf": [schema]}}
    return schema


@pytest.mark.parametrize("as_text", [True, False])
def test_a_deeply_nested_schema_is_a_client_error_not_a_recursion_error(as_text):
    schema = nested(110)  # ~330 JSON levels
    with pytest.raises(SchemaError, match="nested more than"):
        StructuredOutputsParams.for_schema(json.dumps(schema) if as_text else schema)
    StructuredOutputsParams.for_schema(json.dumps(nested(MAX_SCHEMA_DEPTH // 4)))  # within the limit


def test_a_huge_enum_is_refused_before_compiling():
    with pytest.raises(SchemaError, match="enum values"):
        StructuredOutputsParams.for_schema({"type": "string", "enum": [f"v{i}" for i in range(100_000)]})
    StructuredOutputsParams.for_schema({"type": "string", "enum": [f"v{i}" for i in range(MAX_ENUM_VALUES)]})


def test_many_optional_properties_are_refused():
    props = {f"p{i}": {"type": "integer"} for i in range(1500)}
    with pytest.raises(SchemaError, match="optional properties"):
        StructuredOutputsParams.for_schema({"type": "object", "properties": props})
    few = {f"p{i}": {"type": "integer"} for i in range(MAX_OPTIONAL_PROPERTIES)}
    StructuredOutputsParams.for_schema({"type": "object", "properties": few})


@pytest.mark.parametrize("schema", [
    {"$ref": "#"},
    {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    {"$defs": {"x": {"$ref": "#/$defs/y"}, "y": {"$ref": "#/$defs/x"}}, "$ref": "#/$defs/x"},
    {"type": "object", "properties": {"a": False}, "required": ["a"]},
    {"enum": []},
])
def test_a_schema_no_value_satisfies_is_refused(schema):
    with pytest.raises(SchemaError, match="admits no value"):
        StructuredOutputsParams.for_schema(schema)


def test_recursive_schemas_with_a_way_out_are_kept():
    tree = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}, "required": ["kids"]}
    StructuredOutputsParams.for_schema(tree)
    optional = {"type": "object", "properties": {"next": {"$ref": "#"}}}
    StructuredOutputsParams.for_schema(optional)


def test_schema_errors_are_client_errors_and_value_errors():
    with pytest.raises(ClientError):
        StructuredOutputsParams.for_schema("not json")
    assert issubclass(SchemaError, ValueError)


def test_the_grammar_cache_is_bounded_by_bytes(tmp_path):
    from helpers.tiny_models import make_qwen_checkpoint
    from mmserve.worker.grammar import GrammarCache

    model_dir = make_qwen_checkpoint(tmp_path)
    cache = GrammarCache(model_dir, 1400, max_bytes=1)
    for i in range(3):
        cache.matcher(StructuredOutputsParams.for_schema({"enum": [f"a{i}", "b"]}), 0)
        assert len(cache._compiled) == 1 and cache.num_bytes == next(iter(cache._compiled.values())).memory_size_bytes
    big = GrammarCache(model_dir, 1400)
    for i in range(3):
        big.matcher(StructuredOutputsParams.for_schema({"enum": [f"a{i}", "b"]}), 0)
    assert len(big._compiled) == 3
