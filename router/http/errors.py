"""Errors of the HTTP API in OpenAI's JSON shape, ``{"error": {"message", "type", "param", "code"}}``.

The router's statuses map onto HTTP ones: INVALID_ARGUMENT 400 (the gRPC API's message),
UNAUTHENTICATED 401, RESOURCE_EXHAUSTED 429 with ``Retry-After`` (no stream slot, no KV blocks, not
admitted), UNAVAILABLE 503 (no worker, workers kept failing), DEADLINE_EXCEEDED 504, anything else 500.
Request bodies that do not parse (unknown fields included) are 400s naming the field.
"""

from __future__ import annotations

import logging
import math
import re
from typing import Any, TypeVar

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

ModelT = TypeVar("ModelT", bound=BaseModel)

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1  # Retry-After of a 429 whose message gives no hint of its own
_HINT = re.compile(r"retry after ([0-9.]+) s")

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
              404: "invalid_request_error", 405: "invalid_request_error", 413: "invalid_request_error",
              429: "rate_limit_error", 503: "service_unavailable_error", 504: "timeout_error"}


# Anthropic's error types by status (its Messages API answers errors as {"type": "error", "error": {type, message}})
ANTHROPIC_ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                        404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                        503: "overloaded_error", 504: "api_error"}
ANTHROPIC_PATHS = ("/v1/messages",)


class ApiError(Exception):
    """An error answer: HTTP ``status`` and OpenAI's error fields (``type`` follows the status)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        message, param = _text(message), None if param is None else _text(param)   # may quote the client
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = dict(headers or {})

    def body(self) -> dict:
        """The JSON body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": ERROR_TYPE.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}

    def response(self, anthropic: bool = False) -> JSONResponse:
        """The whole answer: status, headers and body (in Anthropic's shape for its Messages API)."""
        return JSONResponse(self.anthropic_body() if anthropic else self.body(), status_code=self.status,
                            headers=self.headers)

    def anthropic_body(self) -> dict:
        """Anthropic's error body: ``{"type": "error", "error": {"type", "message"}}`` (the field at fault named in
        the message, which has no ``param``)."""
        where = f" (`{self.param}`)" if self.param and f"`{self.param}`" not in self.message else ""
        return {"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPE.get(self.status, "api_error"),
                                           "message": self.message + where}}


def _text(s: str) -> str:
    """``s`` with any lone surrogate written as its escape (``\\ud800``), so that the JSON body renders."""
    return s.encode("utf-8", "backslashreplace").decode("utf-8")


def from_status(code: grpc.StatusCode, message: str) -> ApiError:
    """The HTTP error for a router status and message (:class:`router.recovery.GenerateError`'s);
    a 429 carries ``Retry-After``: the admission's hint when the message has one, else 1 second."""
    status = HTTP_STATUS.get(code, 500)
    headers = {}
    if status == 429:
        hint = _HINT.search(message)
        headers["Retry-After"] = str(max(1, math.ceil(float(hint.group(1)))) if hint else RETRY_AFTER_S)
    return ApiError(status, message, code=code.name.lower(), headers=headers)


def validate_part(model: type[ModelT], value: Any, where: str) -> ModelT:
    """``value`` (a part of a body the route reads itself, e.g. ``tools.2``) as ``model``.

    Raises:
        ApiError: 400 naming the first field that does not parse (``tools.2.name``) and pydantic's complaint.
    """
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        err = exc.errors()[0]
        at = ".".join([where, *(str(p) for p in err["loc"])])
        raise ApiError(400, f"`{at}`: {err['msg']}", param=at) from None


def _field(loc: tuple) -> str:
    return ".".join(str(part) for part in loc if part != "body") or "body"


def validation_error(exc: RequestValidationError) -> ApiError:
    """A 400 naming every field of the body that did not parse: ``unknown parameter `x` `` for a field
    the API does not have, else the field and pydantic's complaint."""
    problems, first = [], None
    for err in exc.errors():
        loc = tuple(err.get("loc", ()))
        if err.get("type") == "json_invalid":
            problems.append(f"the request body is not valid JSON ({err.get('ctx', {}).get('error', 'parse error')})")
            continue
        if err.get("type") == "invalid_unicode":
            problems.append(err.get("msg"))
            first = first or err.get("ctx", {}).get("where")
            continue
        if err.get("type") == "one_prompt":       # a body-level rule (TokenizeRequest): its own words
            problems.append(err.get("msg"))
            first = first or "prompt"
            continue
        name = _field(loc)
        first = first or name
        if err.get("type") == "extra_forbidden":
            problems.append(f"unknown parameter `{name}`")
        elif name == "body":
            problems.append(f"the request body must be a JSON object sent with `Content-Type: application/json` "
                            f"({err.get('msg')})")
        else:
            problems.append(f"`{name}`: {err.get('msg')}")
    return ApiError(400, "; ".join(problems) or "invalid request", param=first)


def install_handlers(app: FastAPI) -> None:
    """Answer every error of ``app`` in OpenAI's shape (Anthropic's under :data:`ANTHROPIC_PATHS`): :class:`ApiError`,
    bodies that do not parse, Starlette's own (unknown path 404, wrong method 405) and unexpected exceptions (500,
    logged)."""

    def shaped(request: Request) -> bool:
        return request.url.path in ANTHROPIC_PATHS

    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response(shaped(request))

    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response(shaped(request))

    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return ApiError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {})).response(shaped(request))

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("HTTP %s %s failed", request.method, request.url.path)
        return ApiError(500, f"internal error: {type(exc).__name__}").response(shaped(request))

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(RequestValidationError, invalid_body)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)
