from __future__ import annotations

from backend_engine.structured_output.json_format import closed_objects


def test_objects_that_list_properties_are_closed_however_nested() -> None:
    schema = {
        "type": "object",
        "properties": {
            "items": {"type": "array", "items": {"properties": {"x": {}}}},
            "free": {"type": "object"},
            "typed": {"properties": {}, "additionalProperties": {"type": "string"}},
            "patterned": {"properties": {}, "patternProperties": {"^a": {}}},
        },
        "$defs": {"node": {"properties": {"n": {"$ref": "#/$defs/node"}}}},
        "anyOf": [{"properties": {"k": {}}}],
        "const": {"properties": {"kept": "as data"}},
    }
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["items"]["items"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]["free"]
    assert closed["properties"]["typed"]["additionalProperties"] == {"type": "string"}
    assert "additionalProperties" not in closed["properties"]["patterned"]
    assert closed["$defs"]["node"]["additionalProperties"] is False
    assert closed["anyOf"][0]["additionalProperties"] is False
    assert closed["const"] == {"properties": {"kept": "as data"}}
    assert "additionalProperties" not in schema  # the client's schema is not changed
