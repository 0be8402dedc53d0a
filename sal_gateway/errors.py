"""The gateway's exception tree and its single mapping to OpenAI-style JSON errors.

::

    GatewayError                      any error the gateway answers itself
    ├── BadRequest          400       malformed JSON, wrong types, prompt too long
    │   └── ModelNotFound   404       unknown `model`
    ├── BodyTooLarge        413       body over `proxy.max_body_bytes`
    ├── NoBackendAvailable  503       no eligible backend for the model
    └── UpstreamError       502       the backend failed before answering (connect refused,
        └── UpstreamTimeout 504       reset, malformed answer) / timed out

`error_body()` and `error_status()` are the only places that turn them into HTTP; the app, the
proxy and the SSE error event all call them, so every error a client sees has the shape
``{"error": {"message": str, "type": str, "code": int | str | None, "param": ...}}``.
"""

from __future__ import annotations

from typing import Any


class GatewayError(Exception):
    """Base class. `status` is the HTTP status, `error_type` the OpenAI ``type`` field."""

    status: int = 500
    error_type: str = "internal_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.backend: str | None = None
        """The backend involved, for metrics labels (None: none was chosen)."""
        self.counted = False
        """True when `sal_requests_total` already counted this failure."""


class BadRequest(GatewayError):
    status = 400
    error_type = "invalid_request_error"


class ModelNotFound(BadRequest):
    status = 404
    error_type = "NotFoundError"


class BodyTooLarge(GatewayError):
    status = 413
    error_type = "invalid_request_error"


class NoBackendAvailable(GatewayError):
    status = 503
    error_type = "service_unavailable"


class UpstreamError(GatewayError):
    status = 502
    error_type = "upstream_error"


class UpstreamTimeout(UpstreamError):
    status = 504
    error_type = "upstream_timeout"


def error_body(exc: GatewayError) -> dict[str, Any]:
    """The OpenAI-style JSON error object for `exc` (``code`` is the HTTP status)."""
    return {
        "error": {
            "message": exc.message,
            "type": exc.error_type,
            "param": exc.param,
            "code": exc.status,
        }
    }


def error_status(exc: GatewayError) -> int:
    """The HTTP status a client gets for `exc`."""
    return exc.status
