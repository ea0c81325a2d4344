"""Refuse JSON-schema features the grammar cannot honour, naming each and where it is.

xgrammar compiles some keywords into nothing (it accepts outputs that break them); a user
who asked for them would get outputs that fail their own validator. Found by compiling a
schema with each keyword and feeding it an instance that breaks it
(tests/test_structured_outputs.py keeps the list honest: every refused keyword here is one
xgrammar ignores, and the honoured ones pass through).
"""

from __future__ import annotations

from typing import Any

# keyword -> why it is refused
IGNORED_KEYWORDS = {
    "not": "negation",
    "if": "conditional subschemas",
    "then": "conditional subschemas",
    "else": "conditional subschemas",
    "dependentRequired": "property dependencies",
    "dependentSchemas": "property dependencies",
    "dependencies": "property dependencies",
    "uniqueItems": "unique array items",
}
# string formats the grammar enforces (by syntax: a "date" has a day of 01-31 whatever the month);
# any other "format" is refused
HONOURED_FORMATS = frozenset(
    "email date time date-time duration uuid uri uri-reference uri-template hostname ipv4 ipv6 "
    "json-pointer relative-json-pointer".split()
)
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties", "contains", "propertyNames", "unevaluatedProperties",
               "unevaluatedItems", "not", "if", "then", "else")


def unsupported_features(schema: Any, path: str = "#") -> list[str]:
    """Every feature of ``schema`` the grammar would ignore, as "<keyword> (<what>) at <path>"."""
    found: list[str] = []
    if not isinstance(schema, dict):
        return found
    for key, what in IGNORED_KEYWORDS.items():
        if key in schema and not (key == "uniqueItems" and schema[key] is False):
            found.append(f"'{key}' ({what}) at {path}")
    fmt = schema.get("format")
    if isinstance(fmt, str) and fmt not in HONOURED_FORMATS:
        found.append(f"'format': '{fmt}' at {path} (enforced formats: {', '.join(sorted(HONOURED_FORMATS))})")
    if "multipleOf" in schema and not (isinstance(schema["multipleOf"], int) and schema.get("type") == "integer"):
        found.append(f"'multipleOf' on a non-integer at {path} (only integer multiples of integers are enforced)")
    if len(schema.get("allOf") or []) > 1:
        found.append(f"'allOf' with more than one subschema at {path}")
    if "oneOf" in schema and "discriminator" not in schema and len(schema["oneOf"]) > 1:
        # enforced as anyOf: exactly-one holds only when the branches are disjoint, as with a discriminator
        found.append(f"'oneOf' without a discriminator at {path} (use anyOf)")
    for key in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                found += unsupported_features(sub, f"{path}/{key}/{name}")
    for key in _SUBSCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                found += unsupported_features(sub, f"{path}/{key}/{i}")
    for key in _SUBSCHEMAS:
        if key not in IGNORED_KEYWORDS and isinstance(schema.get(key), dict):
            found += unsupported_features(schema[key], f"{path}/{key}")
    return found
