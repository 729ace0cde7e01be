"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, each with its HTTP status."""
from __future__ import annotations

import re
import uuid

import msgspec

from surge.logger import init_logger

logger = init_logger(__name__)


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo


class APIError(Exception):
    """Raised anywhere below a route; the app answers it as an OpenAI error."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def to_response(self) -> ErrorResponse:
        return ErrorResponse(ErrorInfo(self.message, self.type, self.param, self.code))


def internal_error(e: BaseException, where: str) -> APIError:
    """A 500 that tells the client nothing of the server's insides; the log has the exception, under the same id."""
    error_id = uuid.uuid4().hex[:12]
    logger.error("internal error %s on %s: %s: %s", error_id, where, type(e).__name__, e, exc_info=e)
    return APIError(500, f"the server failed on this request (error id {error_id}, in the server log)",
                    code="internal_error")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


_PATH = re.compile(r" - at `\$\.?(.*)`$")
_MISSING = re.compile(r"^Object missing required field `(\w+)`")


def from_validation_error(e: msgspec.ValidationError) -> APIError:
    """A msgspec message such as "Expected `int`, got `str` - at `$.max_tokens`" -> 400 naming the parameter."""
    message = str(e)
    path = _PATH.search(message)
    param = path.group(1) if path else None
    missing = _MISSING.match(message)
    if missing:
        param = f"{param}.{missing.group(1)}" if param else missing.group(1)
    return bad_request(f"invalid request: {message}", param=param,
                       code="missing_required_parameter" if missing else "invalid_type")
