"""The HTTP edge every request crosses: the API key, a JSON body that is bounded in size and depth and declared as
JSON, and a last-resort handler that answers an unexpected exception as an OpenAI 500 and keeps the connection.
"""
from __future__ import annotations

import hmac

from starlette.requests import Request
from starlette.responses import Response

from surge.entrypoints.openai.errors import APIError, internal_error
from surge.entrypoints.openai.limits import ServerLimits
from surge.entrypoints.openai.protocol import decode_request
from surge.entrypoints.openai.serving import encode

# Paths anyone may read without the API key: probes and scrapers.
OPEN_PATHS = ("/health", "/version", "/metrics")


def error_response(e: APIError) -> Response:
    return Response(encode(e.to_response()), status_code=e.status, media_type="application/json")


def bearer_token(authorization: bytes) -> bytes | None:
    """The credentials of an `Authorization: Bearer KEY` header; the scheme is case-insensitive (RFC 9110)."""
    scheme, _, token = authorization.strip().partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" and token.strip() else None


class ApiKeyMiddleware:
    """Bearer-token check in front of every path except the open ones (pure ASGI: streaming stays untouched)."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            token = bearer_token(dict(scope["headers"]).get(b"authorization", b""))
            if token is None or not hmac.compare_digest(token, self.expected):
                error = APIError(401, "invalid API key: send it as 'Authorization: Bearer <key>'",
                                 code="invalid_api_key")
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class InternalErrorMiddleware:
    """An exception no handler took becomes an OpenAI-shaped 500 here, below Starlette's ServerErrorMiddleware, which
    would re-raise it to the HTTP server and so drop a keep-alive connection the client still counts on."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as e:
            error = internal_error(e, scope.get("path", "?"))
            if started:  # a body is under way: the only honest end left is to close the connection
                raise
            await error_response(error)(scope, receive, send)


async def read_json(request: Request, limits: ServerLimits, request_type: type):
    """The body decoded into request_type: application/json, at most max_body_bytes, at most max_json_depth deep."""
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise APIError(415, f"Content-Type must be application/json, got {media_type or 'none'!r}",
                       code="unsupported_media_type")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit():
        limits.check_body_size(int(length))
    chunks, size = [], 0
    async for chunk in request.stream():  # a chunked body has no length to check up front
        size += len(chunk)
        limits.check_body_size(size)
        chunks.append(chunk)
    body = b"".join(chunks)
    limits.check_depth(body)
    return decode_request(body, request_type)
