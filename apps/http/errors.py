"""Refusals in OpenAI's error shape (`{"error": {"message", "type", "param", "code"}}`), each
message one line, and pydantic's validation errors said in one line naming the field."""

from __future__ import annotations

import re
from typing import Any, Mapping, Optional, Sequence

from fastapi.responses import JSONResponse


class ApiError(Exception):
    """A refusal in OpenAI's error shape: status, one-line message, type, param and code."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: Optional[str] = None,
                 code: Optional[str] = None, headers: Optional[dict[str, str]] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code, self.headers = status, message, type, param, code, headers

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.type, self.param, self.code, self.headers)

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(status: int, message: str, type: str = "invalid_request_error", param: Optional[str] = None,
                   code: Optional[str] = None, headers: Optional[dict[str, str]] = None) -> JSONResponse:
    return JSONResponse(error_body(message, type, param, code), status_code=status, headers=headers)


def one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


#: pydantic's names of a union's members in an error's location ("str", "list[str]"): not fields.
UNION_MEMBER = re.compile(r"^(str|int|float|bool|none|(list|dict|nullable|union|function-\w+)\[.*\])$")
#: What a value must be, by pydantic's error type, for a union's message ("text or a list").
KINDS = {"string_type": "text", "int_type": "an integer", "float_type": "a number", "bool_type": "true or false",
         "list_type": "a list", "dict_type": "an object", "none_required": "null"}


def validation_message(errors: Sequence[Mapping[str, Any]]) -> tuple[str, Optional[str]]:
    """One line for pydantic's errors and the field it names: the first field's (its deepest
    location; a union's members merged: "stop must be text or a list"), and how many other
    fields are wrong."""
    groups: dict[tuple, list] = {}
    for error in errors:
        loc = tuple(str(p) for p in error.get("loc", ()) if p != "body" and not UNION_MEMBER.match(str(p)))
        groups.setdefault(loc, []).append(error)
    top = next(iter(groups))[:1]
    loc = max((g for g in groups if g[:1] == top), key=len)
    found, where = groups[loc], ".".join(loc) or None
    first, kind = found[0], found[0].get("type", "")
    if kind == "json_invalid":
        message = f"the request body is not valid JSON ({first.get('ctx', {}).get('error', 'cannot parse it')})"
        where = None
    elif kind in ("model_type", "model_attributes_type", "dict_type") and not loc:
        message = "the request body must be a JSON object"
    elif kind == "missing":
        message = f"{where} is required"
    elif kind == "extra_forbidden":
        message = f"unknown field {where!r}: this server does not take it"
    elif len(found) > 1 and all(e.get("type") in KINDS for e in found):
        message = f"{where} must be " + " or ".join(dict.fromkeys(KINDS[e["type"]] for e in found))
    else:
        message = f"{where}: {first.get('msg', 'invalid value')}" if where else str(first.get("msg", "invalid value"))
    others = len({g[:1] for g in groups}) - 1
    if others:
        message += f" (and {others} more field{'s' if others > 1 else ''})"
    return one_line(message), where
