"""Constraints the structured-output tests run: 20+ JSON schemas covering the features users
reach for, plus regexes, an EBNF grammar (with its own parser, to check outputs), choices."""

from __future__ import annotations

import re

NAME = {"type": "string", "minLength": 1, "maxLength": 10}

SCHEMAS = [
    # flat objects, required vs optional
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999}, "note": NAME},
     "required": ["id"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "value": {"type": "null"}}, "required": ["ok", "value"]},
    # nested objects
    {"type": "object", "properties": {"user": {"type": "object", "properties": {"name": NAME, "admin": {"type": "boolean"}},
                                               "required": ["name", "admin"]}}, "required": ["user"]},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "integer", "minimum": -5, "maximum": 5}}, "required": ["c"]}}, "required": ["b"]}}, "required": ["a"]},
    # arrays with min / max items
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "array", "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 3}, {"type": "boolean"}], "items": False},
    # enums and const
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": [1, 2, 3]}},
     "required": ["color", "size"]},
    {"type": "object", "properties": {"kind": {"const": "point"}, "x": {"type": "integer", "minimum": 0, "maximum": 50}},
     "required": ["kind", "x"]},
    # anyOf and nullable types
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 100}, {"type": "boolean"}]},
    {"type": "object", "properties": {"v": {"anyOf": [NAME, {"type": "null"}]}}, "required": ["v"]},
    {"type": "object", "properties": {"n": {"type": ["integer", "null"], "minimum": 0, "maximum": 9}}, "required": ["n"]},
    # $ref / $defs
    {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                                      "y": {"type": "integer", "minimum": 0, "maximum": 9}},
                      "required": ["x", "y"]}},
     "type": "object", "properties": {"start": {"$ref": "#/$defs/pt"}, "end": {"$ref": "#/$defs/pt"}},
     "required": ["start", "end"]},
    {"$defs": {"item": {"type": "object", "properties": {"sku": NAME, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                        "required": ["sku", "qty"]}},
     "type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 2},
    # string length / pattern
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}, "required": ["code"]},
    {"type": "object", "properties": {"word": {"type": "string", "minLength": 3, "maxLength": 5}}, "required": ["word"]},
    {"type": "string", "pattern": "^(yes|no)[!?]$"},
    # integer and number bounds
    {"type": "object", "properties": {"t": {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 20}},
     "required": ["t"]},
    {"type": "object", "properties": {"p": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["p"]},
    {"type": "integer", "minimum": -50, "maximum": -10},
    # formats the grammar enforces
    {"type": "object", "properties": {"day": {"type": "string", "format": "date"}}, "required": ["day"]},
    {"type": "object", "properties": {"extra": {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0,
                                                                                          "maximum": 9},
                                                "propertyNames": {"pattern": "^[a-z]{1,4}$"}, "maxProperties": 2}},
     "required": ["extra"]},
]

REGEXES = [r"[0-9]{3}-[a-z]{2,4}", r"(cat|dog|bird)s?", r"[A-Z][a-z]{1,6} [0-9]{1,2}", r"0x[0-9a-f]{4}"]

ARITHMETIC = r"""
root ::= expr
expr ::= term (("+" | "-") term){0,3}
term ::= factor (("*" | "/") factor){0,2}
factor ::= num | "(" expr ")"
num ::= [0-9] | [1-9] [0-9]
"""

CHOICES = [["yes", "no", "maybe so"], ["alpha", "beta", "gamma", "delta"], ['quote "q"', "back\\slash", "naïve"]]


def parses_arithmetic(text: str) -> bool:
    """A recursive-descent parser of ARITHMETIC (the test's own: it does not trust the grammar)."""
    pos = 0

    def num():
        nonlocal pos
        m = re.match(r"[1-9][0-9]|[0-9]", text[pos:])
        if not m:
            raise ValueError
        pos += m.end()

    def factor():
        nonlocal pos
        if text[pos : pos + 1] == "(":
            pos += 1
            expr()
            if text[pos : pos + 1] != ")":
                raise ValueError
            pos += 1
        else:
            num()

    def chain(operand, ops, most):
        """operand (op operand){0,most}: the shape of both expr and term"""
        def parse():
            nonlocal pos
            operand()
            for _ in range(most):
                if pos < len(text) and text[pos] in ops:
                    pos += 1
                    operand()
        return parse

    term = chain(factor, "*/", 2)
    expr = chain(term, "+-", 3)

    try:
        expr()
    except ValueError:
        return False
    return pos == len(text)
