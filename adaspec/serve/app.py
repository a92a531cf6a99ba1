"""The FastAPI application: routes, and a gate for API keys, draining and error counting."""
from __future__ import annotations

import hmac
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from adaspec import __version__
from adaspec.serve.errors import APIError, error_response, install_handlers
from adaspec.serve.generation import generate
from adaspec.serve.metrics import CONTENT_TYPE_LATEST
from adaspec.serve.prepare import (chat_prompt_ids, completion_prompt_ids, detokenize, prepare_chat,
                                   prepare_completion)
from adaspec.serve.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from adaspec.serve.state import ServeState


class _Gate:
    """Pure ASGI middleware (BaseHTTPMiddleware would get in the way of disconnect handling).

    - with --api-key, every /v1 path (known or not) needs ``Authorization: Bearer KEY``;
    - while draining, everything but /metrics is refused with 503 so balancers move on;
    - error statuses on /v1 are counted for /metrics.
    """

    def __init__(self, app, state: ServeState):
        self.app, self.state = app, state
        key = state.settings.api_key
        self._expected = f"Bearer {key}".encode() if key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path: str = scope.get("path", "")
        is_v1 = path == "/v1" or path.startswith("/v1/")
        if is_v1 and self._expected is not None:
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
        if not is_v1:
            return await self.app(scope, receive, send)

        async def counting_send(message):
            if message["type"] == "http.response.start" and message["status"] >= 400:
                self._count(message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)

    def _count(self, status: int) -> None:
        m = self.state.metrics
        if m is not None:
            m.on_error(status)


async def _body(request: Request, model):
    raw = await request.body()
    return model.model_validate_json(raw or b"null")  # pydantic errors become 400s


def build_app(state: ServeState) -> FastAPI:
    app = FastAPI(title="adaspec", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
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

    @app.get("/v1/models")
    async def models():
        data = [{"id": name, "object": "model", "created": started, "owned_by": "adaspec",
                 "root": state.settings.model_path or name, "parent": None, "max_model_len": state.max_model_len}
                for name in state.settings.served_model_names]
        return {"object": "list", "data": data}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req: CompletionRequest = await _body(request, CompletionRequest)
        state.check_model(req.model)
        prompts, params = prepare_completion(state, req)
        return await generate(state, request, prompts, params, chat=False, stream=bool(req.stream),
                              include_usage=bool(req.stream_options and req.stream_options.include_usage))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req: ChatCompletionRequest = await _body(request, ChatCompletionRequest)
        state.check_model(req.model)
        ids, params = prepare_chat(state, req)
        return await generate(state, request, [ids], params, chat=True, stream=bool(req.stream),
                              include_usage=bool(req.stream_options and req.stream_options.include_usage))

    @app.post("/tokenize")
    async def tokenize_route(request: Request):
        req: TokenizeRequest = await _body(request, TokenizeRequest)
        state.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "Send exactly one of prompt or messages.", "prompt")
        ids = completion_prompt_ids(state, req.prompt) if req.prompt is not None else chat_prompt_ids(
            state, req.messages)
        return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize_route(request: Request):
        req: DetokenizeRequest = await _body(request, DetokenizeRequest)
        state.check_model(req.model)
        return JSONResponse({"prompt": detokenize(state, req.tokens)})

    return app
