"""OpenAI-format error bodies and the exception handlers that produce them.

Every failure, including FastAPI's own validation and routing errors, leaves as
``{"error": {"message", "type", "param", "code"}}`` so OpenAI clients raise the right exception
class; nothing a client sends may surface as a 500.
"""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from adaspec.errors import InvalidRequestError

log = logging.getLogger("adaspec.serve")

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",  # what OpenAI returns for a bad key (code invalid_api_key)
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error meant for the client, with its HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


class QueueFullError(APIError):
    def __init__(self, limit: int):
        super().__init__(503, f"The server's waiting queue is full ({limit} requests); retry later.",
                         code="queue_full", headers={"Retry-After": "1"})


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def from_api_error(e: APIError) -> JSONResponse:
    return error_response(e.status, e.message, e.param, e.code, e.headers)


_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none"}


def _param_of(loc: tuple) -> str | None:
    # pydantic appends union member names ("str", "list[int]") to the location: not a param.
    parts = [str(p) for p in loc if not (isinstance(p, str) and (p in _TYPE_NAMES or "[" in p or "-" in p))]
    return ".".join(parts) or None


def from_validation_error(e: ValidationError | RequestValidationError) -> JSONResponse:
    errors = e.errors()
    if any(err.get("type") == "json_invalid" for err in errors):
        return error_response(400, "The request body is not valid JSON.", code="invalid_json")
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = tuple(first.get("loc", ()))
    if loc and loc[0] == "body":  # FastAPI's location prefix
        loc = loc[1:]
    param = _param_of(loc)
    if first.get("type") == "model_type" and not loc:
        return error_response(400, "The request body must be a JSON object.", code="invalid_type")
    if first.get("type") == "missing":
        return error_response(400, f"Missing required parameter: {param}.", param, "missing_required_parameter")
    msg = f"Invalid value for {param}: {first.get('msg')}." if param else str(first.get("msg"))
    if len(errors) > 1 and param and all(_param_of(tuple(x.get("loc", ()))) == param for x in errors):
        msgs = dict.fromkeys(x.get("msg", "") for x in errors)  # ordered, deduplicated
        msg = f"Invalid type for {param}: " + " or ".join(msgs) + "."
    return error_response(400, msg, param, "invalid_value")


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api(request: Request, e: APIError):
        return from_api_error(e)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(request: Request, e: InvalidRequestError):
        return error_response(400, str(e), e.param, "invalid_value")

    @app.exception_handler(ValidationError)
    async def _pyd(request: Request, e: ValidationError):
        return from_validation_error(e)

    @app.exception_handler(RequestValidationError)  # FastAPI answers these with 422 by default
    async def _req(request: Request, e: RequestValidationError):
        return from_validation_error(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        msg = e.detail if isinstance(e.detail, str) else "HTTP error"
        if e.status_code == 404:
            msg = f"Not found: {request.method} {request.url.path}"
        return error_response(e.status_code, msg, headers=getattr(e, "headers", None))

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, e: ClientDisconnect):
        # the client closed the connection before its body was in: no error of the server's, and
        # nobody reads the answer (499: nginx's "client closed request"), so one quiet log line,
        # not an internal error's tracebacks that any client could flood the log with
        log.info("client went away during %s %s before its body arrived", request.method, request.url.path)
        return error_response(499, "The client closed the connection before sending the whole body.")

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        log.exception("internal error on %s %s", request.method, request.url.path)
        return error_response(500, f"Internal server error: {type(e).__name__}: {e}")
