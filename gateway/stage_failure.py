"""What the gateway raises when a stage could not do its part, with the HTTP answer it maps to.

Routes never see raw ``grpc`` exceptions: a gRPC status (the call failed) or a typed stage ``Error``
message (the stage answered with one) both become a :class:`StageFailure` carrying the stage, an HTTP
status and a stable code.
"""

from __future__ import annotations

import grpc

from services.common.errors import CODE_NAMES
from services.common.pb import common_pb2

# Typed stage error code -> (HTTP status, OpenAI-style error type).
_STAGE_ERROR_HTTP: dict[int, tuple[int, str]] = {
    common_pb2.ERROR_CODE_INVALID_ARGUMENT: (400, "invalid_request_error"),
    common_pb2.ERROR_CODE_CONTEXT_LENGTH_EXCEEDED: (400, "invalid_request_error"),
    common_pb2.ERROR_CODE_UNSUPPORTED_MEDIA: (400, "invalid_request_error"),
    common_pb2.ERROR_CODE_BAD_REFERENCE_AUDIO: (400, "invalid_request_error"),
    common_pb2.ERROR_CODE_FAILED_PRECONDITION: (400, "invalid_request_error"),
    common_pb2.ERROR_CODE_RESOURCE_EXHAUSTED: (429, "RateLimitError"),
    common_pb2.ERROR_CODE_UNAVAILABLE: (503, "ServiceUnavailableError"),
    common_pb2.ERROR_CODE_DEADLINE_EXCEEDED: (504, "TimeoutError"),
    common_pb2.ERROR_CODE_CANCELLED: (499, "CancelledError"),
    common_pb2.ERROR_CODE_OUT_OF_ORDER: (500, "InternalServerError"),
    common_pb2.ERROR_CODE_INTERNAL: (500, "InternalServerError"),
}
_GRPC_STATUS_HTTP: dict[grpc.StatusCode, tuple[int, str, str]] = {
    grpc.StatusCode.UNAVAILABLE: (503, "ServiceUnavailableError", "stage_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "TimeoutError", "stage_deadline_exceeded"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "RateLimitError", "stage_resource_exhausted"),
    grpc.StatusCode.INVALID_ARGUMENT: (400, "BadRequestError", "invalid_argument"),
    grpc.StatusCode.UNIMPLEMENTED: (503, "ServiceUnavailableError", "stage_unimplemented"),
    grpc.StatusCode.CANCELLED: (499, "CancelledError", "cancelled"),
}


class StageFailure(Exception):
    """A stage could not do its part; carries what the HTTP layer needs to answer the client."""

    def __init__(
        self,
        stage: str,
        status: int,
        message: str,
        code: str,
        err_type: str,
        param: str | None = None,
        retry_after_s: int | None = None,
        client_code: bool = False,
    ):
        super().__init__(f"{stage}: {message}")
        self.stage = stage
        self.status = status
        self.message = message
        self.code = code
        self.err_type = err_type
        self.param = param or None
        self.retry_after_s = retry_after_s  # sent as Retry-After when the failure is answered before a stream
        # True when ``code`` is the stage's typed reason (context_length_exceeded, invalid_argument, ...):
        # it is then the OpenAI envelope's ``code``, which tells the client what to fix.
        self.client_code = client_code

    @classmethod
    def from_rpc_error(cls, stage: str, target: str, err: grpc.aio.AioRpcError) -> StageFailure:
        status, err_type, code = _GRPC_STATUS_HTTP.get(err.code(), (502, "BadGatewayError", "stage_failed"))
        if err.code() == grpc.StatusCode.UNAVAILABLE:
            message = f"{stage} stage is unavailable at {target}: {err.details() or 'connection failed'}"
        elif err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            message = f"{stage} stage did not finish within its deadline"
        else:
            message = f"{stage} stage failed ({err.code().name}): {err.details()}"
        return cls(stage, status, message, code, err_type, retry_after_s=1 if status in (429, 503) else None)

    @classmethod
    def from_stage_error(cls, stage: str, err: common_pb2.Error) -> StageFailure:
        status, err_type = _STAGE_ERROR_HTTP.get(err.code, (500, "InternalServerError"))
        code = CODE_NAMES.get(err.code, "stage_error")
        return cls(
            stage,
            status,
            f"{stage}: {err.message}",
            code,
            err_type,
            err.param or None,
            retry_after_s=1 if status == 429 else None,
            client_code=True,
        )
