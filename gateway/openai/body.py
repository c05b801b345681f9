"""Reading a JSON request body safely: size, content type, and what JSON allows but nothing downstream can hold.

``json.loads`` happily returns values the rest of the gateway cannot use: ``NaN``/``Infinity`` literals
(and ``1e400``, which overflows to infinity), strings with lone UTF-16 surrogates (``"\\ud800"``, which no
UTF-8 encoder - protobuf, the JSON response writer - accepts), and arbitrarily deep nesting (which ends in
a ``RecursionError`` in whatever walks it next). Each of those used to surface as a 500 after the request
was half processed; here they are refused up front with a 400 that names the place, so every later step
(validation, protobuf, error rendering) only ever sees finite numbers, encodable strings and shallow trees.
"""

from __future__ import annotations

import json
import math
from typing import Any

from fastapi import Request

from gateway.openai.errors import APIError

MAX_NESTING = 64  # a chat body nests ~6 deep; anything near this is not a chat request
_JSON_TYPES = ("application/json",)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a valid JSON number")


def _path(parts: list[str | int]) -> str | None:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out or None


def _bad_string(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def check_json_value(value: object) -> None:
    """Refuse non-finite numbers, unencodable strings and nesting deeper than :data:`MAX_NESTING`.

    Iterative (an explicit stack), so the check itself cannot hit the recursion limit it guards against.
    """
    stack: list[tuple[Any, list[str | int]]] = [(value, [])]
    while stack:
        node, path = stack.pop()
        if len(path) > MAX_NESTING:
            raise APIError(400, f"request body nests deeper than {MAX_NESTING} levels", None)
        if isinstance(node, float) and not math.isfinite(node):
            raise APIError(
                400,
                f"'{_path(path)}' is not a finite number (NaN and Infinity are not accepted)",
                _path(path),
            )
        if isinstance(node, str) and _bad_string(node):
            raise APIError(
                400, f"'{_path(path)}' contains a lone UTF-16 surrogate (not valid Unicode text)", _path(path)
            )
        if isinstance(node, dict):
            for key, item in node.items():
                if _bad_string(key):
                    raise APIError(400, "an object key contains a lone UTF-16 surrogate", _path(path))
                stack.append((item, [*path, key]))
        elif isinstance(node, list):
            stack.extend((item, [*path, i]) for i, item in enumerate(node))


def _check_content_type(request: Request) -> None:
    """415 unless the body is declared as JSON (``application/json`` or ``application/*+json``).

    A missing header is accepted: some minimal clients send none, and the body is still parsed strictly.
    """
    raw = request.headers.get("content-type")
    if raw is None:
        return
    media_type = raw.split(";", 1)[0].strip().lower()
    if media_type in _JSON_TYPES or (media_type.startswith("application/") and media_type.endswith("+json")):
        return
    shown = media_type[:80].encode("ascii", "replace").decode()
    raise APIError(
        415, f"Content-Type must be application/json, got '{shown}'", None, "UnsupportedMediaTypeError"
    )


async def read_json_body(request: Request, limit: int) -> object:
    """The body as checked JSON: 413 over ``limit`` bytes, 415 not JSON-typed, 400 malformed or unusable.

    The body is read to its end before a 415 so that the kept-alive connection stays in step.
    """
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body is {declared} bytes, over the limit of {limit}", None)
    buf = bytearray()
    async for piece in request.stream():
        buf.extend(piece)
        if len(buf) > limit:
            raise APIError(413, f"request body is over the limit of {limit} bytes", None)
    _check_content_type(request)
    try:
        value = json.loads(buf, parse_constant=_refuse_constant)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, or a NaN / Infinity literal
        raise APIError(400, f"request body is not valid JSON: {exc}", None) from exc
    except RecursionError as exc:
        raise APIError(400, f"request body nests deeper than {MAX_NESTING} levels", None) from exc
    check_json_value(value)
    return value
