"""The FastAPI application: the routes (gate.py guards them, openapi.py describes them)."""
from __future__ import annotations

import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from adaspec import __version__
from adaspec.serve.errors import APIError, error_response, install_handlers
from adaspec.serve.gate import Gate
from adaspec.serve.generation import generate
from adaspec.serve.metrics import CONTENT_TYPE_LATEST
from adaspec.serve.openapi import install_openapi, json_body
from adaspec.serve.prepare import (chat_request_ids, completion_prompt_ids, detokenize, prepare_chat,
                                   prepare_completion)
from adaspec.serve.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from adaspec.serve.state import ServeState
from adaspec.serve.tools import tools_for_template


# A request whose body is at most this large is parsed and tokenized on the event loop; a larger
# one in a worker thread. The hop to a thread is not free for the loop (anyio's limiter, a cancel
# scope, a future, a wake-up: ~0.15 ms of its time each way, two hops per request): with 256 streams
# it was a fifth of the HTTP side's time per request on a 2-core machine. And it buys nothing for
# a short prompt: the HF tokenizer holds the GIL while it encodes (a loop in another thread ran at
# 7% of its speed meanwhile), so a worker thread stalls the loop just as long. 16 KiB of text
# tokenize in ~4 ms here; above it the thread at least lets the loop run between the calls.
INLINE_BODY_BYTES = 16 * 1024


async def _off_loop_if_large(size: int, fn, *args):
    if size <= INLINE_BODY_BYTES:
        return fn(*args)
    return await run_in_threadpool(fn, *args)


async def _body(request: Request, model):
    """(the validated body, its size in bytes); pydantic's errors become 400s."""
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":  # as vLLM: a form or text/plain body is not silently parsed
        raise APIError(415, f"Unsupported media type {media_type or '(none)'!r}: send the body as JSON with "
                            "'Content-Type: application/json'.", code="unsupported_media_type")
    raw = await request.body()
    return await _off_loop_if_large(len(raw), model.model_validate_json, raw or b"null"), len(raw)


def build_app(state: ServeState) -> FastAPI:
    app = FastAPI(title="adaspec", version=__version__, docs_url="/docs", redoc_url=None, openapi_url="/openapi.json")
    install_openapi(app)
    install_handlers(app)
    app.add_middleware(Gate, state=state)
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

    # Tokenizing a large body runs in a worker thread, a small one on the loop (INLINE_BODY_BYTES)
    @app.post("/v1/completions", openapi_extra=json_body(CompletionRequest))
    async def completions(request: Request):
        req, size = await _body(request, CompletionRequest)
        state.check_model(req.model)
        prompts, params, echo = await _off_loop_if_large(size, prepare_completion, state, req)
        return await generate(state, request, prompts, params, chat=False, stream=bool(req.stream),
                              stream_options=req.stream_options, echo=echo)

    @app.post("/v1/chat/completions", openapi_extra=json_body(ChatCompletionRequest))
    async def chat_completions(request: Request):
        req, size = await _body(request, ChatCompletionRequest)
        state.check_model(req.model)
        # a request's own chat template (--trust-request-chat-template) renders off the loop, whatever its size
        ids, params, reading = await _off_loop_if_large(size if req.chat_template is None else INLINE_BODY_BYTES + 1,
                                                        prepare_chat, state, req)
        return await generate(state, request, [ids], params, chat=True, stream=bool(req.stream),
                              stream_options=req.stream_options, reading=reading)

    @app.post("/tokenize", openapi_extra=json_body(TokenizeRequest))
    async def tokenize_route(request: Request):
        req, size = await _body(request, TokenizeRequest)
        state.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "Send exactly one of prompt or messages.", "prompt")
        ids = await _off_loop_if_large(
            size, lambda: completion_prompt_ids(state, req.prompt, req.add_special_tokens) if req.prompt is not None
            else chat_request_ids(state, req, tools_for_template(req.tools)))
        body = {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}
        if req.return_token_strs:
            if state.tokenizer is None:
                raise APIError(400, "This server runs with --skip-tokenizer-init: it has no token strings.",
                               "return_token_strs")
            body["token_strs"] = state.tokenizer.convert_ids_to_tokens(ids)
        return body

    @app.post("/detokenize", openapi_extra=json_body(DetokenizeRequest))
    async def detokenize_route(request: Request):
        req, size = await _body(request, DetokenizeRequest)
        state.check_model(req.model)
        return JSONResponse({"prompt": await _off_loop_if_large(size, detokenize, state, req.tokens)})

    return app
