"""The OpenAI/vLLM error envelope: ``{"error": {"message", "type", "param", "code"}}`` with code = status."""

from __future__ import annotations

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


class APIError(Exception):
    """Raised anywhere in request handling; the app renders it as the envelope with ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None, err_type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.err_type = err_type or _TYPES.get(status, "APIError")


def error_body(status: int, message: str, param: str | None = None, err_type: str | None = None) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": err_type or _TYPES.get(status, "APIError"),
            "param": param,
            "code": status,
        }
    }


def error_response(exc: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return JSONResponse(error_body(exc.status, exc.message, exc.param, exc.err_type), exc.status, headers=headers)
