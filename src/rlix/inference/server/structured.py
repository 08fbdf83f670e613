"""Structured outputs on the OpenAI surface: `response_format` and vLLM's `structured_outputs` ->
one `OutputConstraint` for the engine, checked and bounded before any work.

vLLM 0.32's meaning: `response_format` {"type": "json_object"} (any JSON object) or
{"type": "json_schema", "json_schema": {"name", "schema", "strict"}} (JSON matching the schema;
"text" is no constraint) takes precedence over `structured_outputs`, which names exactly one of
`json` (a schema, as an object or as JSON text), `json_object`, `regex`, `choice` (the output is
one of the strings), `grammar` (EBNF; xgrammar's dialect, as vLLM's xgrammar backend takes it)
or `structural_tag` (xgrammar's structural-tag JSON). Its option `disable_any_whitespace`
drops whitespace between JSON tokens; `disable_additional_properties` is what the library does
anyway (objects are closed unless the schema opens them). A forced tool call overrides both
(tool_calls.forced_call_constraint), as in vLLM.

Shapes are checked here (a 400 naming the field); whether a schema, regex or grammar compiles is
checked by the engine when the request is handed to it, still before the answer's first byte
(constrained.py, a 400 naming the same field).
"""

from __future__ import annotations

import json
from typing import Any

from rlix.errors import InvalidRequestError
from rlix.inference.engine.api import OutputConstraint
from rlix.inference.server.limits import (MAX_CHOICE_CHARS, MAX_CHOICES, MAX_CONSTRAINT_CHARS,
                                          MAX_STRUCTURAL_TAG_CHARS)

#: the constraint keys of `structured_outputs` (exactly one of them is set)
KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
#: its options, with the values accepted (None: any)
OPTIONS = {"disable_any_whitespace": (True, False), "disable_additional_properties": (True, False),
           "disable_fallback": (True, False), "whitespace_pattern": (None,)}


def _text(value: Any, param: str, what: str, most: int = MAX_CONSTRAINT_CHARS) -> str:
    """A constraint's text (a schema given as an object is serialised), bounded."""
    if isinstance(value, (dict, bool)) and what == "JSON schema":
        value = json.dumps(value)
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"{param} must be a non-empty {what}", param=param)
    if len(value) > most:
        raise InvalidRequestError(f"{param} holds {len(value)} characters; at most {most} "
                                  f"are accepted", param=param)
    return value


def _schema(value: Any, param: str) -> str:
    """A JSON schema (an object, or JSON text of one) as JSON text."""
    text = _text(value, param, "JSON schema")
    if isinstance(value, str):
        try:
            parsed = json.loads(text)
        except (json.JSONDecodeError, RecursionError):
            raise InvalidRequestError(f"{param} is not valid JSON", param=param) from None
        if not isinstance(parsed, (dict, bool)):
            raise InvalidRequestError(f"{param} must be a JSON schema (an object)", param=param)
    return text


def from_response_format(rf: Any) -> OutputConstraint | None:
    """OpenAI's `response_format` (None or "text": no constraint)."""
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise InvalidRequestError("response_format must be an object with a `type`", param="response_format")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return OutputConstraint("json_object", param="response_format")
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidRequestError("When response_format type is 'json_schema', the 'json_schema' field "
                                      "must be provided.", param="response_format")
        schema = spec.get("schema", spec.get("json_schema"))
        if schema is None:  # OpenAI's schema is optional: then any JSON object
            return OutputConstraint("json_object", param="response_format.json_schema")
        return OutputConstraint("json", _schema(schema, "response_format.json_schema.schema"),
                                param="response_format.json_schema.schema")
    raise InvalidRequestError(f"response_format.type {str(kind)[:40]!r} is not supported (use 'text', "
                              "'json_object' or 'json_schema')", param="response_format.type")


def from_structured_outputs(so: Any, where: str = "structured_outputs") -> OutputConstraint | None:
    """vLLM's `structured_outputs` (None: no constraint)."""
    if so is None:
        return None
    if not isinstance(so, dict):
        raise InvalidRequestError(f"{where} must be an object", param=where)
    for key, value in so.items():
        if key not in KINDS and key not in OPTIONS:
            raise InvalidRequestError(f"unknown field `{where}.{str(key)[:40]}` (constraints: {', '.join(KINDS)})",
                                      param=f"{where}.{str(key)[:40]}")
        if key in OPTIONS and value not in OPTIONS[key] and value is not None:
            raise InvalidRequestError(f"`{where}.{key}`={json.dumps(value)[:60]} is not supported",
                                      param=f"{where}.{key}")
    set_kinds = [k for k in KINDS if so.get(k) is not None]
    if len(set_kinds) != 1:
        raise InvalidRequestError(f"{where} must name exactly one constraint of {', '.join(KINDS)}; "
                                  f"got {len(set_kinds)}", param=where)
    kind = set_kinds[0]
    param = f"{where}.{kind}"
    value = so[kind]
    any_ws = not so.get("disable_any_whitespace", False)
    if kind == "json":
        return OutputConstraint("json", _schema(value, param), any_whitespace=any_ws, param=param)
    if kind == "json_object":
        if value is not True:
            raise InvalidRequestError(f"{param} must be true", param=param)
        return OutputConstraint("json_object", any_whitespace=any_ws, param=param)
    if kind == "choice":
        if not (isinstance(value, list) and value):
            raise InvalidRequestError(f"{param} must be a non-empty list of strings", param=param)
        if len(value) > MAX_CHOICES:
            raise InvalidRequestError(f"{param} holds {len(value)} entries; at most {MAX_CHOICES} are accepted",
                                      param=param)
        for i, c in enumerate(value):
            if not isinstance(c, str) or not c or len(c) > MAX_CHOICE_CHARS:
                raise InvalidRequestError(f"{param}[{i}] must be a non-empty string of at most "
                                          f"{MAX_CHOICE_CHARS} characters", param=param)
        return OutputConstraint("choice", choices=tuple(value), param=param)
    what = {"regex": "regex", "grammar": "grammar (EBNF)", "structural_tag": "structural tag (JSON text)"}[kind]
    most = MAX_STRUCTURAL_TAG_CHARS if kind == "structural_tag" else MAX_CONSTRAINT_CHARS
    return OutputConstraint(kind, _text(value, param, what, most), param=param)  # type: ignore[arg-type]


def request_constraint(response_format: Any, structured_outputs: Any) -> OutputConstraint | None:
    """A text endpoint's constraint: `response_format` when it constrains, else `structured_outputs`
    (vLLM's precedence); both are checked."""
    so = from_structured_outputs(structured_outputs)
    rf = from_response_format(response_format)
    return rf if rf is not None else so
