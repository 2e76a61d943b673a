"""JSON Schemas that structured-output tests run SmolLM2 against: every kind of constraint a
client sends (nested objects, bounded arrays, enums, anyOf, patterns, formats, number ranges,
optional fields, closed objects). Bounded string lengths keep a 135M model's answers short.
"""

from __future__ import annotations

from typing import Any

NAME = {"type": "string", "minLength": 1, "maxLength": 20}

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {
        "type": "object",
        "properties": {
            "name": NAME,
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "format": "email", "maxLength": 40},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": NAME,
                        "quantity": {"type": "integer", "minimum": 1, "maximum": 9},
                    },
                    "required": ["sku", "quantity"],
                    "additionalProperties": False,
                },
            },
            "status": {"enum": ["open", "paid", "shipped"]},
        },
        "required": ["id", "items", "status"],
        "additionalProperties": False,
    },
    "shape": {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "kind": {"const": "circle"},
                    "radius": {"type": "number", "exclusiveMinimum": 0, "maximum": 100},
                },
                "required": ["kind", "radius"],
                "additionalProperties": False,
            },
            {
                "type": "object",
                "properties": {
                    "kind": {"const": "square"},
                    "side": {"type": "number", "minimum": 0, "maximum": 100},
                },
                "required": ["kind", "side"],
                "additionalProperties": False,
            },
        ]
    },
    "event": {
        "type": "object",
        "properties": {
            "title": NAME,
            "date": {"type": "string", "format": "date"},
            "tags": {"type": "array", "items": {"enum": ["work", "home", "travel"]}, "maxItems": 2},
            "location": {
                "type": "object",
                "properties": {
                    "city": NAME,
                    "country": {"type": "string", "pattern": "^[A-Z]{2}$"},
                },
                "required": ["city"],
                "additionalProperties": False,
            },
        },
        "required": ["title", "date", "location"],
        "additionalProperties": False,
    },
    "rating": {
        "type": "object",
        "properties": {
            "score": {"type": "number", "minimum": 1, "maximum": 5},
            "verdict": {"type": "string", "enum": ["good", "bad", "mixed"]},
            "reasons": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 2},
            "recommended": {"type": "boolean"},
            "notes": {"type": ["string", "null"], "maxLength": 30},
        },
        "required": ["score", "verdict", "reasons", "recommended"],
        "additionalProperties": False,
    },
}

PROMPTS: dict[str, str] = {
    "person": "Describe a fictional person as JSON.",
    "order": "Write an example shop order as JSON.",
    "shape": "Describe a geometric shape as JSON.",
    "event": "Describe a calendar event as JSON.",
    "rating": "Rate the movie Jaws as JSON.",
}
