"""The OpenAI/vLLM error envelope: ``{"error": {"message", "type", "param", "code"}}``.

``code`` is a stable string saying what the client must fix when one is known (``invalid_value``,
``context_length_exceeded``, ``image_too_large``, ...), and the HTTP status otherwise (vLLM's spelling,
kept for errors that carry no finer reason: 401, 404, 503, ...). Request-validation refusals use OpenAI's
``type: "invalid_request_error"``.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi.responses import JSONResponse

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestEntityTooLargeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    499: "CancelledError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "TimeoutError",
}


# ``<_io.BytesIO object at 0x7f...>``, ``<function f at 0x...>``: what a library's str(exc) may embed.
_OBJECT_REPR = re.compile(r"<[^<>]{1,200}? at 0x[0-9a-fA-F]+>")


def strip_object_reprs(text: str) -> str:
    """``text`` with Python object reprs replaced by ``<data>``: error messages go to clients, which must
    learn what was wrong with their input, not the server's memory layout or class names."""
    return _OBJECT_REPR.sub("<data>", text)


class APIError(Exception):
    """Raised anywhere in request handling; the app renders it as the envelope with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        err_type: str | None = None,
        headers: dict[str, str] | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.err_type = err_type or _TYPES.get(status, "APIError")
        self.headers = headers or {}
        self.code = code


INVALID_REQUEST = "invalid_request_error"


def invalid_request(
    message: str, param: str | None, code: str = "invalid_value", status: int = 400
) -> APIError:
    """A refusal of the client's input: OpenAI's ``invalid_request_error`` with a reason code and the field."""
    return APIError(status, message, param, INVALID_REQUEST, code=code)


def model_not_found_message(model: str, served: str) -> str:
    """What every route says about a model this server does not serve."""
    return f"The model `{model[:200]}` does not exist. This server serves `{served}`."


def model_not_found(model: str, served: str) -> APIError:
    """404 ``model_not_found`` for ``model`` (the audio routes, ``GET /v1/models/{model}``)."""
    return invalid_request(model_not_found_message(model, served), "model", "model_not_found", status=404)


def error_body(
    status: int,
    message: str,
    param: str | None = None,
    err_type: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    return {
        "error": {
            "message": strip_object_reprs(message),
            "type": err_type or _TYPES.get(status, "APIError"),
            "param": param,
            "code": code if code is not None else status,
        }
    }


def api_error_body(exc: APIError) -> dict[str, Any]:
    """The envelope of ``exc`` (for SSE error events, where no HTTP status can be sent any more)."""
    return error_body(exc.status, exc.message, exc.param, exc.err_type, exc.code)


def error_response(exc: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer", **exc.headers} if exc.status == 401 else exc.headers or None
    return JSONResponse(api_error_body(exc), exc.status, headers=headers)
