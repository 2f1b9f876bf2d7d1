"""The tools and JSON schemas of the constrained-output tests (tests/e2e and
tests/engine/test_closing.py), and the check that a function call keeps to its tool's schema."""

import json
from typing import Any

import jsonschema

CITIES = ["Hangzhou", "Paris", "Lagos", "Lima"]

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "name": "get_weather", "description": "Get the current weather for a city.",
     "parameters": {"type": "object", "properties": {"city": {"enum": CITIES}, "unit": {"enum": ["c", "f"]}},
                    "required": ["city"]}},
    {"type": "function", "name": "add", "description": "Add two integers.",
     "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                                                     "b": {"type": "integer", "minimum": 0, "maximum": 99}},
                    "required": ["a", "b"]}},
    {"type": "function", "name": "search", "description": "Search the web.",
     "parameters": {"type": "object",
                    "properties": {"query": {"type": "string", "maxLength": 16},
                                   "limit": {"type": "integer", "minimum": 1, "maximum": 50},
                                   "filters": {"type": "object",
                                               "properties": {"lang": {"enum": ["en", "fr", "zh"]},
                                                              "safe": {"type": "boolean"}},
                                               "required": ["lang"]}},
                    "required": ["query", "filters"]}},
    {"type": "function", "name": "book", "description": "Book seats.",
     "parameters": {"type": "object",
                    "properties": {"seats": {"type": "array", "items": {"type": "integer", "minimum": 1,
                                                                        "maximum": 60}, "minItems": 1, "maxItems": 3},
                                   "class": {"enum": ["economy", "business"]}},
                    "required": ["seats", "class"]}},
]
PARAMETERS = {tool["name"]: tool["parameters"] for tool in TOOLS}

SCHEMAS: list[dict[str, Any]] = [
    {"type": "object",
     "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0,
                                                                          "maximum": 130}},
     "required": ["name", "age"]},
    {"type": "object",
     "properties": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -99,
                                                                     "maximum": 99},
                                                               "y": {"type": "integer", "minimum": -99,
                                                                     "maximum": 99}},
                              "required": ["x", "y"]},
                    "label": {"enum": ["a", "b", "c"]}},
     "required": ["point"]},
    {"type": "object",
     "properties": {"tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
                    "ok": {"type": "boolean"}, "score": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["tags", "ok", "score"]},
    {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1,
                                                                        "maximum": 9},
                                                                 "kind": {"enum": ["x", "y"]}},
                                "required": ["id", "kind"]},
     "minItems": 1, "maxItems": 3},
    {"type": "object",
     "properties": {"status": {"enum": ["ok", "error"]}, "code": {"type": ["integer", "null"], "minimum": 100,
                                                                   "maximum": 599},
                    "details": {"type": "object", "properties": {"retry": {"type": "boolean"}}}},
     "required": ["status", "code", "details"]},
]


def assert_valid_calls(output: list[dict[str, Any]], allowed: set[str]) -> None:
    assert output, "no output"
    for item in output:
        assert item["type"] == "function_call", item
        assert item["id"].startswith("fc_") and item["call_id"].startswith("call_")
        assert item["name"] in allowed
        assert isinstance(item["arguments"], str)
        jsonschema.validate(json.loads(item["arguments"]), PARAMETERS[item["name"]])
