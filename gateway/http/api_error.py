"""``ApiError``: a request refused, as a status and OpenAI's error body (``gateway/app.py`` renders
it; on Anthropic's route in Anthropic's shape, ``routes.anthropic.error_body``)."""

from __future__ import annotations

from aiohttp import web

REFUSAL = web.RequestKey("refusal", str)  # why the request was answered with an error (the access log says it)


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error", headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type, self.headers = status, message, param, code, type_, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def note_refusal(request: web.Request, err: ApiError) -> None:
    """Keep why ``request`` ended in an error for the access log, also where the error went out
    inside a stream that had already answered 200."""
    request[REFUSAL] = f"{err.code or err.type}: {err.message}"[:300]
