"""/openapi.json is served and describes what the server accepts: schemathesis generates requests
from it (valid and schema-violating bodies) against the app on the fake engine; none may get a
5xx, and a body the schema forbids must be refused with a 4xx."""
from __future__ import annotations

import httpx
import pytest
from fake_engine import FakeEngine
from hypothesis import HealthCheck, settings

schemathesis = pytest.importorskip("schemathesis")
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import negative_data_rejection  # noqa: E402

from adaspec.serve.app import build_app  # noqa: E402
from adaspec.serve.server import start_engine  # noqa: E402
from adaspec.serve.state import ServerSettings, ServeState  # noqa: E402


@pytest.fixture(scope="module")
def app():
    settings_ = ServerSettings(served_model_names=["fake"], max_queue=64)
    et = start_engine(lambda: FakeEngine(max_num_seqs=8, max_model_len=128), settings_)
    yield build_app(ServeState(settings=settings_, engine_thread=et))
    et.stop()


@pytest.fixture(scope="module")
def api_schema(app):
    return schemathesis.openapi.from_asgi("/openapi.json", app)


def test_openapi_json_lists_every_route_with_its_request_body(fake_server):
    doc = httpx.get(fake_server.url + "/openapi.json").json()
    paths = doc["paths"]
    for route in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        ref = paths[route]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        name = ref.rsplit("/", 1)[1]
        assert name in doc["components"]["schemas"], name
    for route in ("/health", "/metrics", "/v1/models", "/version"):
        assert route in paths
    props = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"prompt", "max_tokens", "top_k", "seed", "min_tokens"} <= set(props)
    assert httpx.get(fake_server.url + "/docs").status_code == 200


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
def test_generated_requests_never_5xx_and_schema_violations_are_4xx(case):
    if case.method.upper() == "POST":
        case.headers = {**(case.headers or {}), "Content-Type": "application/json"}
    if isinstance(case.body, dict) and case.body.get("stream") is True:
        case.body["stream"] = False  # one JSON body per response
    case.call_and_validate(checks=[not_a_server_error, negative_data_rejection])
