"""The server says which event loop and HTTP parser uvicorn runs (serve/server.py: http_stack)."""
import importlib.util
import sys

import uvicorn

from adaspec.serve.server import http_stack


async def app(scope, receive, send):  # never called: only the config is loaded
    raise AssertionError


def test_forced_pure_python_stack_is_named():
    assert http_stack(uvicorn.Config(app, loop="asyncio", http="h11")) == "asyncio event loop, h11 HTTP"


def test_auto_takes_uvloop_and_httptools_when_installed():
    uv = importlib.util.find_spec("uvloop") is not None and sys.platform != "win32"
    ht = importlib.util.find_spec("httptools") is not None
    want = f"{'uvloop' if uv else 'asyncio'} event loop, {'httptools' if ht else 'h11'} HTTP"
    assert http_stack(uvicorn.Config(app)) == want
