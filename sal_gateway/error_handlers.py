"""OpenAI-shaped answers for errors raised outside the gateway's own handlers.

`install_error_handlers(app)` maps Starlette's routing errors (404 unknown path, 405 wrong
method), FastAPI's parameter validation (422) and any unexpected exception (500, logged with
the request id, which the client's message names; never a traceback) to `errors.error_body`.
`error_response()` is the one place a `GatewayError` becomes a JSON response.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from sal_gateway.admission import request_id_of
from sal_gateway.errors import (
    GatewayError,
    InvalidParams,
    MethodNotAllowed,
    PathNotFound,
    error_body,
)

logger = logging.getLogger("sal_gateway.app")


def error_response(exc: GatewayError) -> JSONResponse:
    return JSONResponse(error_body(exc), status_code=exc.status, headers=exc.headers or None)


def _http_error(request: Request, exc: StarletteHTTPException) -> GatewayError:
    """Starlette's routing errors as gateway errors (the path is the client's: bounded)."""
    where = f"{request.method[:16]} {request.url.path[:200]}"
    if exc.status_code == 404:
        return PathNotFound(f"Invalid URL ({where}): no such route")
    if exc.status_code == 405:
        return MethodNotAllowed(f"Method not allowed ({where})", headers=dict(exc.headers or {}))
    err = GatewayError(f"{exc.detail} ({where})", headers=dict(exc.headers or {}))
    err.status = exc.status_code
    if exc.status_code < 500:
        err.error_type = "invalid_request_error"
    return err


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(StarletteHTTPException)
    async def _routing_error(request: Request, exc: StarletteHTTPException) -> Response:
        return error_response(_http_error(request, exc))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(p) for p in first.get("loc", ()))
        msg = f"invalid request: {str(first.get('msg', 'validation failed'))[:200]}"
        return error_response(InvalidParams(msg, param=loc or None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        rid = request_id_of(request)
        logger.exception(
            "unexpected error on %s %s (request id %s)", request.method, request.url.path, rid
        )
        response = error_response(GatewayError(f"internal gateway error (request id {rid})"))
        response.headers["X-Request-Id"] = rid  # outside FrontDoor: add it here
        return response
