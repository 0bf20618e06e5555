"""Every failure as an OpenAI-style body: {"error": {"message", "type", "param", "code"}}.

Clients (the official SDKs included) read `error.message` and branch on the status code, so
each refusal says what was wrong and what the limit is, and nothing leaks as a bare 500
with a stack trace or as FastAPI's default 422 shape.
"""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from flashtree.errors import ChatTemplateError, FlashtreeError, PromptTooLong, QueueFull
from flashtree.server.loop import EngineFailed, EngineStopped

log = logging.getLogger("flashtree.server")
FIELD = re.compile(r"[a-z_][a-z0-9_]*")
TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}
ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
               408: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
               503: "service_unavailable"}


class APIError(Exception):
    """Raised by handlers for a refusal with a status, e.g. an unknown model (404)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def param_path(loc: tuple) -> str | None:
    """('body', 'messages', 0, 'content', 'str') -> 'messages[0].content' (union tags dropped)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part != "body" and FIELD.fullmatch(part) and part not in TYPE_TAGS:
            out += f".{part}" if out else part
    return out or None


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """One readable line from pydantic's errors; for unions, the most specific complaint."""
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        reason = (first.get("ctx") or {}).get("error", "not valid JSON")
        return f"malformed JSON body: {reason}", None
    if tuple(first.get("loc", ())) == ("body",):
        if first.get("type") == "missing":
            return "the request body is missing; send a JSON object", None
        if first.get("type") in ("model_attributes_type", "model_type", "dict_type"):
            return "the request body must be a JSON object", None
    specific = [e for e in errors if not e.get("type", "").endswith("_type")] or errors
    err = specific[0]
    ctx = err.get("ctx") or {}
    if err.get("type") in ("unsupported", "field_error"):  # raised by model validators, which name the field
        return err["msg"], ctx.get("field")
    if err.get("type") == "context_length_exceeded":
        return err["msg"], None
    param = param_path(tuple(err.get("loc", ())))
    msg = err.get("msg", "invalid value").removeprefix("Value error, ")
    if err.get("type") == "extra_forbidden":
        msg = "unknown field; see the API schema at /docs for the supported ones"
    return (f"{param}: {msg}" if param else msg), param


def install_error_handlers(app: FastAPI, on_refusal) -> None:
    """on_refusal(status) lets metrics count 4xx refusals by kind."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        on_refusal(400)
        errors = list(exc.errors())
        message, param = validation_message(errors)
        if param is None and "json" not in request.headers.get("content-type", ""):
            message = "send the body as JSON with the header Content-Type: application/json"
        too_long = errors and errors[0].get("type") == "context_length_exceeded"
        return error_response(400, message, param, "context_length_exceeded" if too_long else "invalid_value")

    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError):
        on_refusal(exc.status)
        return error_response(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(QueueFull)
    async def _full(request: Request, exc: QueueFull):
        on_refusal(429)
        return error_response(429, str(exc), None, "queue_full", headers={"Retry-After": "1"})

    @app.exception_handler(FlashtreeError)
    async def _bad(request: Request, exc: FlashtreeError):
        on_refusal(400)
        if isinstance(exc, PromptTooLong):
            return error_response(400, str(exc), None, "context_length_exceeded")
        if isinstance(exc, ChatTemplateError):
            return error_response(400, str(exc), "messages", "invalid_messages")
        return error_response(400, str(exc), None, "invalid_prompt")

    @app.exception_handler(EngineFailed)
    async def _failed(request: Request, exc: EngineFailed):
        return error_response(500, str(exc), None, "engine_error")

    @app.exception_handler(EngineStopped)
    async def _stopped(request: Request, exc: EngineStopped):
        return error_response(503, str(exc), None, "shutting_down")

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        if exc.status_code == 400:  # FastAPI's "error parsing the body": bad UTF-8, absurd nesting
            on_refusal(400)
            return error_response(400, "malformed JSON body: it could not be parsed as UTF-8 JSON", None,
                                  "invalid_value")
        # Starlette's own refusals: 404 unknown route, 405 wrong method.
        where = f"{request.method} {request.url.path}"
        if exc.status_code == 404:
            message, code = f"no such endpoint: {where}; the API is under /v1 (see /docs)", "unknown_url"
        elif exc.status_code == 405:
            allowed = (getattr(exc, "headers", None) or {}).get("Allow", "another method")
            message, code = f"{where} is not allowed; this endpoint takes {allowed}", "method_not_allowed"
        else:
            message, code = str(exc.detail), "http_error"
        return error_response(exc.status_code, message, None, code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return error_response(500, f"internal error ({type(exc).__name__}); the server is still running",
                              None, "internal_error")
