"""Request bodies: JSON that does not parse, text that is not valid Unicode and JSON of the wrong shape are 400s in
OpenAI's shape, the last two naming the field (pydantic's validation errors translated)."""
from __future__ import annotations

import json
import re
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from tokenmill.serve.errors import APIError, bad_request

T = TypeVar("T", bound=BaseModel)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


LARGE_BODY = 1 << 16  # bytes: larger bodies are parsed in the slow lane


async def parse_body(raw: Request, model: type[T]) -> T:
    """JSON that does not parse, text that is not valid Unicode and JSON of the wrong shape are 400s, the
    last two naming the field."""
    body = await raw.body()
    if len(body) > LARGE_BODY:  # parsed in the slow lane, so the event loop keeps streaming others' tokens
        return await raw.app.state.tokenmill.run_blocking(_parse, body, model, size=len(body))
    return _parse(body, model)


def _parse(body: bytes, model: type[T]) -> T:
    try:
        data = json.loads(body, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise APIError(400, f"We could not parse the JSON body of your request: {e}", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "The request body must be a JSON object.", None, "invalid_json")
    if _MAY_HOLD_SURROGATES.search(body):
        check_unicode(data)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e.errors(include_url=False)) from None


# JSON spells a lone surrogate as an escape (\ud800..\udfff), or as its UTF-8-style bytes, which json.loads decodes
# with "surrogatepass". Bodies with neither (nearly all) skip the walk below.
_MAY_HOLD_SURROGATES = re.compile(rb"\\[uU][dD][89a-fA-F]|\xed[\xa0-\xbf]")


def check_unicode(data: Any) -> None:
    """Every string of parsed JSON (keys too) must be encodable as UTF-8: a lone surrogate would otherwise fail
    later, in the tokenizer or while writing the answer (a 500 on `model`). One walk here covers every route
    and field; iterative, as the nesting may be deep."""
    stack: list[tuple[tuple, Any]] = [((), data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, path + (key,))
                if isinstance(item, (str, dict, list)):
                    stack.append((path + (key,), item))
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, (str, dict, list)):
                    stack.append((path + (i,), item))


def _check_text(text: str, path: tuple) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        param = ".".join(str(p).encode("utf-8", "backslashreplace").decode() for p in path) or None
        raise bad_request(f"{param or 'The request'} contains text that is not valid Unicode: a lone surrogate "
                          f"U+{ord(text[e.start]):04X} at character {e.start}.", param) from None


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "json-or-python"}
# What a pydantic type error expected, in OpenAI's words ("Invalid type for 'n': expected an integer, ...").
_EXPECTED = {"int_type": "an integer", "float_type": "a number", "bool_type": "a boolean", "string_type": "a string",
             "list_type": "an array", "dict_type": "an object", "model_type": "an object",
             "model_attributes_type": "an object"}


def _field_path(loc) -> str:
    """`messages.0.role` from a pydantic location, without the union-member tags ('str', 'list[int]')."""
    parts = [str(x) for x in loc if x != "body"]
    return ".".join(p for p in parts if p not in _TYPE_TAGS and "[" not in p)


def _json_kind(value: Any) -> str:
    for kind, name in ((bool, "a boolean"), (int, "an integer"), (float, "a decimal number"), (str, "a string"),
                       (list, "an array"), (dict, "an object")):
        if isinstance(value, kind):
            return name
    return "null" if value is None else type(value).__name__


def _message(loc: str, errs: list[dict]) -> str:
    expected = [_EXPECTED.get(e.get("type")) for e in errs]
    if loc and all(expected):
        wanted = " or ".join(dict.fromkeys(expected))
        return f"Invalid type for '{loc}': expected {wanted}, but got {_json_kind(errs[0].get('input'))} instead"
    msg = str(errs[0].get("msg"))
    return f"{loc}: {msg}" if loc else msg


def validation_error(errors) -> APIError:
    """A 400 (as OpenAI and vLLM answer a wrong type) whose `param` is the first bad field's path."""
    by_loc: dict[str, list[dict]] = {}
    for err in errors:
        by_loc.setdefault(_field_path(err.get("loc", ())), []).append(err)
    parts = [_message(loc, errs) for loc, errs in list(by_loc.items())[:5]]
    param = next(iter(by_loc), None) or None
    return APIError(400, "; ".join(parts) + "." if parts else "Invalid request.", param, "invalid_type")
