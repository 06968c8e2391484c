"""The server's errors: OpenAI's error shape and statuses, the exceptions the serving code raises
(OpenAIError), how engine exceptions map onto them, and the reason each is counted under on
/metrics (request_errors)."""

from __future__ import annotations

import contextlib
import json
import logging

from pagedllm.engine.request_checks import BadRequest
from pagedllm.engine.streams import EngineDeadError, RequestFailedError

logger = logging.getLogger("pagedllm")

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
# /metrics' request_errors reason of an answer's status (OpenAIError.reason may say better)
_ERROR_REASONS = {
    400: "bad_request", 401: "unauthorized", 404: "not_found", 413: "too_large",
    499: "client_disconnected", 503: "unavailable",
}  # fmt: skip


def error_reason(status: int) -> str:
    return _ERROR_REASONS.get(status, "internal" if status >= 500 else "bad_request")


@contextlib.contextmanager
def bad_request_checked():
    """A BadRequest of engine/request_checks.py answered as a 400 naming its field."""
    try:
        yield
    except BadRequest as e:
        raise OpenAIError(str(e), param=e.param) from None


class OpenAIError(Exception):
    """Answered as OpenAI's {"error": {...}} with this status; `reason` labels it on /metrics
    (default: by its status)."""

    def __init__(
        self, message: str, status: int = 400, param: str | None = None, reason: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.reason = reason or error_reason(status)

    def body(self) -> dict:
        return error_body(self.message, self.status, self.param)


def error_body(message: str, status: int, param: str | None = None) -> dict:
    kind = _ERROR_TYPES.get(status, "BadRequestError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def engine_error(e: BaseException) -> BaseException:
    """An engine exception as the OpenAIError it deserves (others pass through)."""
    if isinstance(e, ValueError):
        return OpenAIError(str(e))
    if isinstance(e, EngineDeadError):
        return OpenAIError(str(e), 503)
    if isinstance(e, RequestFailedError):  # the message names the request
        return OpenAIError(str(e), 500)
    return e


def request_failed(request_id: str, e: BaseException) -> OpenAIError:
    """A failure while answering one request (not bad input): a 500 that names it."""
    if isinstance(e, OpenAIError):
        return e
    logger.error("request %s failed: %r", request_id, e, exc_info=e)
    return OpenAIError(f"request {request_id} failed: {e!r}", 500)


def stream_error(e: BaseException, request_id: str) -> str:
    """An error after a stream started (its status already sent), as an in-band event."""
    error = engine_error(e)
    if not isinstance(error, OpenAIError):
        error = request_failed(request_id, e)
    return json.dumps(error.body())
