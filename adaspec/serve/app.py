"""The FastAPI application: routes, and a gate for API keys, draining and error counting."""
from __future__ import annotations

import hmac
import time

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from pydantic.json_schema import models_json_schema
from starlette.concurrency import run_in_threadpool

from adaspec import __version__
from adaspec.serve.errors import APIError, error_response, from_api_error, install_handlers
from adaspec.serve.generation import generate
from adaspec.serve.metrics import CONTENT_TYPE_LATEST
from adaspec.serve.prepare import (chat_prompt_ids, completion_prompt_ids, detokenize, prepare_chat,
                                   prepare_completion)
from adaspec.serve.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from adaspec.serve.state import ServeState


_KEYED_PATHS = ("/tokenize", "/detokenize")  # not under /v1, but they run the tokenizer on client input


class BodyTooLarge(APIError):
    def __init__(self, limit: int):
        super().__init__(413, f"The request body is larger than the server's limit of {limit} bytes "
                              f"(--max-request-body-bytes).", code="request_too_large")


class _Gate:
    """Pure ASGI middleware (BaseHTTPMiddleware would get in the way of disconnect handling).

    - with --api-key, every /v1 path (known or not) and /tokenize, /detokenize need
      ``Authorization: Bearer KEY``;
    - while draining, everything but /metrics is refused with 503 so balancers move on;
    - a body over --max-request-body-bytes is a 413: at once from Content-Length, else as soon as
      the bytes read pass the limit (a chunked upload), never buffered whole;
    - error statuses on /v1 are counted for /metrics.
    """

    def __init__(self, app, state: ServeState):
        self.app, self.state = app, state
        key = state.settings.api_key
        self._expected = f"Bearer {key}".encode() if key else None
        self._limit = state.settings.max_request_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path: str = scope.get("path", "")
        is_v1 = path == "/v1" or path.startswith("/v1/")
        if (is_v1 or path in _KEYED_PATHS) and self._expected is not None:
            got = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(got, self._expected):
                self._count(401)
                resp = error_response(401, "Missing or invalid API key: send 'Authorization: Bearer <key>'.",
                                      code="invalid_api_key")
                return await resp(scope, receive, send)
        if self.state.draining and path != "/metrics":
            self._count(503)
            resp = error_response(503, "The server is shutting down.", code="shutting_down",
                                  headers={"Retry-After": "5"})
            return await resp(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self._limit:
            if is_v1:
                self._count(413)
            return await from_api_error(BodyTooLarge(self._limit))(scope, receive, send)
        receive = self._limited(receive)
        if not is_v1:
            return await self.app(scope, receive, send)

        async def counting_send(message):
            if message["type"] == "http.response.start" and message["status"] >= 400:
                self._count(message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)

    def _limited(self, receive):
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self._limit:
                    raise BodyTooLarge(self._limit)  # raised inside request.body(): a 413 response
            return message

        return limited_receive

    def _count(self, status: int) -> None:
        m = self.state.metrics
        if m is not None:
            m.on_error(status)


async def _body(request: Request, model):
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":  # as vLLM: a form or text/plain body is not silently parsed
        raise APIError(415, f"Unsupported media type {media_type or '(none)'!r}: send the body as JSON with "
                            "'Content-Type: application/json'.", code="unsupported_media_type")
    raw = await request.body()
    # parsing a large body takes a while: off the event loop (pydantic errors become 400s)
    return await run_in_threadpool(model.model_validate_json, raw or b"null")


_BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
           "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}


def _json_body(model) -> dict:
    """openapi_extra for a route that parses its own body (to control media type, size, errors)."""
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def _install_openapi(app: FastAPI) -> None:
    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                                 description="OpenAI-compatible API of adaspec (see adaspec/serve/README.md).")
            _, defs = models_json_schema([(m, "validation") for m in _BODIES.values()],
                                         ref_template="#/components/schemas/{model}")
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def build_app(state: ServeState) -> FastAPI:
    app = FastAPI(title="adaspec", version=__version__, docs_url="/docs", redoc_url=None, openapi_url="/openapi.json")
    _install_openapi(app)
    install_handlers(app)
    app.add_middleware(_Gate, state=state)
    app.state.serve = state
    started = int(time.time())

    @app.get("/health")
    async def health():
        if not state.engine_thread.alive:
            return error_response(503, "The engine is not running.", code="engine_dead")
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    for path, fn in (("/health", health), ("/metrics", metrics)):  # load balancers and AIPerf probe with HEAD
        app.add_api_route(path, fn, methods=["HEAD"], include_in_schema=False)

    @app.get("/v1/models")
    async def models():
        data = [{"id": name, "object": "model", "created": started, "owned_by": "adaspec",
                 "root": state.settings.model_path or name, "parent": None, "max_model_len": state.max_model_len}
                for name in state.settings.served_model_names]
        return {"object": "list", "data": data}

    # Tokenizing runs in a worker thread (run_in_threadpool): a long prompt must not stall
    # /health and every other request on the event loop.
    @app.post("/v1/completions", openapi_extra=_json_body(CompletionRequest))
    async def completions(request: Request):
        req: CompletionRequest = await _body(request, CompletionRequest)
        state.check_model(req.model)
        prompts, params = await run_in_threadpool(prepare_completion, state, req)
        return await generate(state, request, prompts, params, chat=False, stream=bool(req.stream),
                              stream_options=req.stream_options)

    @app.post("/v1/chat/completions", openapi_extra=_json_body(ChatCompletionRequest))
    async def chat_completions(request: Request):
        req: ChatCompletionRequest = await _body(request, ChatCompletionRequest)
        state.check_model(req.model)
        ids, params = await run_in_threadpool(prepare_chat, state, req)
        return await generate(state, request, [ids], params, chat=True, stream=bool(req.stream),
                              stream_options=req.stream_options)

    @app.post("/tokenize", openapi_extra=_json_body(TokenizeRequest))
    async def tokenize_route(request: Request):
        req: TokenizeRequest = await _body(request, TokenizeRequest)
        state.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "Send exactly one of prompt or messages.", "prompt")
        ids = await run_in_threadpool(
            lambda: completion_prompt_ids(state, req.prompt) if req.prompt is not None
            else chat_prompt_ids(state, req.messages))
        return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}

    @app.post("/detokenize", openapi_extra=_json_body(DetokenizeRequest))
    async def detokenize_route(request: Request):
        req: DetokenizeRequest = await _body(request, DetokenizeRequest)
        state.check_model(req.model)
        return JSONResponse({"prompt": await run_in_threadpool(detokenize, state, req.tokens)})

    return app
