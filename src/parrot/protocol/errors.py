"""One exception hierarchy for the whole system.

Every error a user can see is a :class:`ParrotError` with an HTTP status, a
stable machine-readable ``code`` and a human message.  The manager maps these
to JSON bodies of the form ``{"error": {"code": ..., "message": ...}}`` in one
place, and the client maps such bodies back to the same classes, so a user of
the Python API sees the very error the server raised.
"""

from __future__ import annotations

from typing import Any, ClassVar


class ParrotError(Exception):
    """Base of all Parrot errors.  ``status`` is the HTTP status it maps to."""

    status: ClassVar[int] = 500
    default_code: ClassVar[str] = "internal_error"

    def __init__(self, message: str, *, code: str | None = None, detail: dict[str, Any] | None = None):
        super().__init__(message)
        self.message = message
        self.code = code or self.default_code
        self.detail = detail or {}

    def to_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.detail:
            body["detail"] = self.detail
        return {"error": body}

    def __reduce__(self):  # keep code/detail when pickled or copied
        return (_rebuild, (type(self), self.message, self.code, self.detail))


def _rebuild(cls: type[ParrotError], message: str, code: str, detail: dict[str, Any]) -> ParrotError:
    return cls(message, code=code, detail=detail)


class BadRequest(ParrotError):
    """The request is malformed or asks for something impossible."""

    status = 400
    default_code = "bad_request"


class InvalidTemplate(BadRequest):
    default_code = "invalid_template"


class InvalidSampling(BadRequest):
    default_code = "invalid_sampling"


class InvalidConstraint(BadRequest, ValueError):
    """A JSON schema, regex or choice list (structured outputs) that is malformed, too large
    or does not compile; a ValueError too, for the Python API.  ``detail["field"]`` names
    the field."""

    default_code = "invalid_constraint"


class InvalidTransform(BadRequest):
    default_code = "invalid_transform"


class BindingError(BadRequest):
    """A placeholder without a binding, or a binding without a placeholder."""

    default_code = "invalid_binding"


class CycleError(BadRequest):
    """A call would consume, directly or transitively, its own output."""

    default_code = "dependency_cycle"


class ContextTooLong(BadRequest):
    """A value or prompt has more tokens than the model's context window."""

    default_code = "context_too_long"


class Unauthorized(ParrotError):
    """No session token was presented."""

    status = 401
    default_code = "unauthorized"


class Forbidden(ParrotError):
    """A session token was presented but does not open this session."""

    status = 403
    default_code = "forbidden"


class NotFound(ParrotError):
    status = 404
    default_code = "not_found"


class Conflict(ParrotError):
    """The request contradicts existing state (e.g. a variable with two producers)."""

    status = 409
    default_code = "conflict"


class PayloadTooLarge(ParrotError):
    status = 413
    default_code = "payload_too_large"


class QuotaExceeded(ParrotError):
    """A tenant holds as much as its quota allows (sessions, unfinished calls, value
    bytes).  ``detail["retry_after_s"]`` says when trying again may succeed; the HTTP
    answer carries it as ``Retry-After``."""

    status = 429
    default_code = "quota_exceeded"

    @property
    def retry_after_s(self) -> int:
        return max(1, int(self.detail.get("retry_after_s", 1)))


class CallFailed(ParrotError):
    """A call failed while running; its outputs and everything downstream carry this."""

    status = 500
    default_code = "call_failed"


class EngineError(ParrotError):
    """An engine failed or could not be reached."""

    status = 502
    default_code = "engine_error"


class NoEngine(ParrotError):
    """No registered engine can serve the request."""

    status = 503
    default_code = "no_engine"


class Timeout(ParrotError):
    status = 504
    default_code = "timeout"


_BY_CODE: dict[str, type[ParrotError]] = {}


def _register(cls: type[ParrotError]) -> None:
    _BY_CODE[cls.default_code] = cls
    for sub in cls.__subclasses__():
        _register(sub)


_register(ParrotError)


def error_from_body(status: int, body: Any) -> ParrotError:
    """Rebuild the exception a server raised from its JSON error body."""
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        return ParrotError(f"HTTP {status}: {body!r}"[:2000], code="http_error")
    code = str(err.get("code", "http_error"))
    cls = _BY_CODE.get(code)
    if cls is None:
        cls = next((c for c in _BY_CODE.values() if c.status == status), ParrotError)
    return cls(str(err.get("message", "")), code=code, detail=err.get("detail") or {})
