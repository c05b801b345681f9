"""Reading a JSON request body safely: size, content type, and what JSON allows but nothing downstream can hold.

``json.loads`` happily returns values the rest of the gateway cannot use: ``NaN``/``Infinity`` literals
(parsed here as floats on purpose, so the refusal can name the field that holds them; ``1e400`` overflows
to infinity the same way), strings with lone UTF-16 surrogates (``"\\ud800"``, which no
UTF-8 encoder - protobuf, the JSON response writer - accepts), and arbitrarily deep nesting (which ends in
a ``RecursionError`` in whatever walks it next). Each of those used to surface as a 500 after the request
was half processed; here they are refused up front with a 400 that names the place, so every later step
(validation, protobuf, error rendering) only ever sees finite numbers, encodable strings and shallow trees.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

from fastapi import Request
from starlette.requests import ClientDisconnect
from starlette.types import Message, Receive

from gateway.openai.errors import APIError, invalid_request

MAX_NESTING = 64  # a chat body nests ~6 deep; anything near this is not a chat request
_JSON_TYPES = ("application/json",)


_CONSTANTS = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _parse_constant(name: str) -> float:
    """``NaN`` / ``Infinity`` / ``-Infinity`` as floats: :func:`check_json_value` then refuses them by path."""
    return _CONSTANTS[name]


class ClientGone(Exception):
    """The client closed the connection before its request body arrived in full (counted as 499)."""


class BodyStalled(Exception):
    """The request body sent nothing for the profile's ``gateway.body_idle_timeout_s`` (answered 408)."""


def idle_limited(receive: Receive, idle_s: float) -> Receive:
    """``receive`` that raises :class:`BodyStalled` when a piece of the request body is not there within
    ``idle_s`` seconds of asking for it, so a client that stalls mid-upload, or trickles bytes to hold the
    socket, is answered instead of holding its connection (and the bytes read so far) forever.

    Only the body is timed: once its last piece has arrived, calls pass straight through, since a
    streaming route then waits on ``receive`` for as long as the client stays (its disconnect).
    """
    body_done = False

    async def receive_limited() -> Message:
        nonlocal body_done
        if body_done:
            return await receive()
        try:
            async with asyncio.timeout(idle_s):
                message = await receive()
        except TimeoutError:
            raise BodyStalled(f"the request body sent nothing for {idle_s:g} s") from None
        if message["type"] != "http.request" or not message.get("more_body", False):
            body_done = True
        return message

    return receive_limited


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
            raise invalid_request(
                f"request body nests deeper than {MAX_NESTING} levels", None, "invalid_json"
            )
        if isinstance(node, float) and not math.isfinite(node):
            raise invalid_request(
                f"'{_path(path)}' is not a finite number (NaN and Infinity are not accepted)", _path(path)
            )
        if isinstance(node, str) and _bad_string(node):
            raise invalid_request(
                f"'{_path(path)}' contains a lone UTF-16 surrogate (not valid Unicode text)", _path(path)
            )
        if isinstance(node, dict):
            for key, item in node.items():
                if _bad_string(key):
                    raise invalid_request("an object key contains a lone UTF-16 surrogate", _path(path))
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

    The body is read to its end before a 415 so that the kept-alive connection stays in step. A client
    that disconnects before the body is complete raises :class:`ClientGone` (the app answers 499).
    """
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(
            413,
            f"request body is {declared} bytes, over the limit of {limit}",
            None,
            code="request_too_large",
        )
    buf = bytearray()
    try:
        async for piece in request.stream():
            buf.extend(piece)
            if len(buf) > limit:
                raise APIError(
                    413, f"request body is over the limit of {limit} bytes", None, code="request_too_large"
                )
    except ClientDisconnect as exc:
        raise ClientGone(f"client disconnected after {len(buf)} body bytes") from exc
    _check_content_type(request)
    return loads_checked(bytes(buf))


def loads_checked(raw: bytes) -> object:
    """``raw`` parsed as JSON and checked by :func:`check_json_value` (400 naming the place otherwise)."""
    try:
        value = json.loads(raw, parse_constant=_parse_constant)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise invalid_request(f"request body is not valid JSON: {exc}", None, "invalid_json") from exc
    except RecursionError as exc:
        raise invalid_request(
            f"request body nests deeper than {MAX_NESTING} levels", None, "invalid_json"
        ) from exc
    check_json_value(value)
    return value
