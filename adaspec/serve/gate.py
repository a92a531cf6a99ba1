"""The ASGI middleware in front of every route: API key, draining, body-size cap, error counts."""
from __future__ import annotations

import hmac

from adaspec.serve.errors import APIError, error_response, from_api_error
from adaspec.serve.state import ServeState

_KEYED_PATHS = ("/tokenize", "/detokenize")  # not under /v1, but they run the tokenizer on client input


class BodyTooLarge(APIError):
    def __init__(self, limit: int):
        super().__init__(413, f"The request body is larger than the server's limit of {limit} bytes "
                              f"(--max-request-body-bytes).", code="request_too_large")


class Gate:
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
