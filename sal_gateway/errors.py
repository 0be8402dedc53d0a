"""The gateway's exception tree and its single mapping to OpenAI-style JSON errors.

::

    GatewayError                      any error the gateway answers itself (500: our fault)
    ├── BadRequest          400       malformed JSON, wrong types, prompt too long
    │   ├── ModelNotFound   404       unknown `model`
    │   ├── TemplateRefused 400       request `chat_template` while not trusted
    │   ├── TemplateTimeout 400       trusted request template over its time budget
    │   └── InvalidParams   422       (framework-level) request validation
    ├── Unauthorized        401       missing or wrong API key (``WWW-Authenticate: Bearer``)
    ├── PathNotFound        404       no such route
    ├── MethodNotAllowed    405       route exists, method does not (``Allow``)
    ├── RequestTimeout      408       body not received within ``listen.body_timeout_s``
    ├── BodyTooLarge        413       body over `proxy.max_body_bytes`
    ├── TooManyRequests     429       over ``limits.max_concurrent_requests`` (``Retry-After``)
    │   └── TemplateBusy    429       every template worker busy (``Retry-After``)
    ├── NoBackendAvailable  503       no eligible backend for the model
    └── UpstreamError       502       the backend failed before answering (connect refused,
        └── UpstreamTimeout 504       reset, malformed answer) / timed out

`error_body()` and `error_status()` are the only places that turn them into HTTP; the app, the
proxy and the SSE error event all call them, so every error a client sees has the shape
``{"error": {"message": str, "type": str, "code": int | str | None, "param": ...}}``
(``code`` is the HTTP status unless the class names a string code, as OpenAI does for
``invalid_api_key``). `GatewayError.headers` are extra response headers the app sends along.
"""

from __future__ import annotations

from typing import Any


class GatewayError(Exception):
    """Base class. `status` is the HTTP status, `error_type` the OpenAI ``type`` field."""

    status: int = 500
    error_type: str = "internal_error"
    code: str | None = None
    """OpenAI's string ``code`` (None: the HTTP status is the code)."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers: dict[str, str] = dict(headers or {})
        """Extra response headers (``Retry-After``, ``Allow``, ...)."""
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


class TemplateRefused(BadRequest):
    """A request-supplied chat template for a model that does not trust them."""


class TemplateTimeout(BadRequest):
    """A trusted request template did not render within its budget (its worker is killed)."""


class InvalidParams(BadRequest):
    status = 422


class Unauthorized(GatewayError):
    status = 401
    error_type = "invalid_request_error"
    code = "invalid_api_key"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"WWW-Authenticate": "Bearer"})


class PathNotFound(GatewayError):
    status = 404
    error_type = "invalid_request_error"


class MethodNotAllowed(GatewayError):
    status = 405
    error_type = "invalid_request_error"


class RequestTimeout(GatewayError):
    status = 408
    error_type = "invalid_request_error"

    def __init__(self, message: str) -> None:
        # The rest of a slow body may still be in flight: never reuse this connection.
        super().__init__(message, headers={"Connection": "close"})


class BodyTooLarge(GatewayError):
    status = 413
    error_type = "invalid_request_error"


class TooManyRequests(GatewayError):
    status = 429
    error_type = "rate_limit_error"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after_s)})


class TemplateBusy(TooManyRequests):
    """Every request-template renderer stayed busy (a capacity limit, like the one above)."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message, retry_after_s)
        self.param = "chat_template"


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
    """The OpenAI-style JSON error object for `exc`."""
    return {
        "error": {
            "message": exc.message,
            "type": exc.error_type,
            "param": exc.param,
            "code": exc.status if exc.code is None else exc.code,
        }
    }


def error_status(exc: GatewayError) -> int:
    """The HTTP status a client gets for `exc`."""
    return exc.status
