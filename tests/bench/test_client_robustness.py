"""The client against odd servers: whatever one request meets (an event that is not a JSON object,
an error page that is not UTF-8, an error event in older vLLM's flat format, a usage that is not a
number) fails that request, never the run; a stream that ends in [DONE] with no finish_reason is
complete (as vLLM's client counts it) and noted."""
import json

from aiohttp import web

from adaspec.bench.runner import BenchConfig, format_summary, run_benchmark

from .fakeserver import FakeServer, Script


def _chunk(text, finish=None, usage=None):
    d = {"object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": finish}]}
    if usage is not None:
        d["usage"] = usage
    return f"data: {json.dumps(d)}\n\n".encode()


USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
# prompt -> (status, body bytes); a 200 body is streamed as server-sent events
ODD = {
    "int": (200, _chunk("a") + b"data: 42\n\n" + _chunk("b", "length") + b"data: [DONE]\n\n"),
    "list": (200, _chunk("a") + b"data: [1,2]\n\n" + _chunk("b", "length") + b"data: [DONE]\n\n"),
    "badutf": (500, b"\xff\xfe error \xc3"),
    "flat": (200, _chunk("a") + b'data: {"object": "error", "message": "engine died", "type": "InternalServerError", '
             b'"param": null, "code": 500}\n\n' + b"data: [DONE]\n\n"),
    "nofinish": (200, _chunk("a") + _chunk("b") + f"data: {json.dumps({'choices': [], 'usage': USAGE})}\n\n".encode()
                 + b"data: [DONE]\n\n"),
    "badusage": (200, _chunk("a") + _chunk("b", "length")
                 + b'data: {"choices": [], "usage": {"completion_tokens": "many"}}\n\n' + b"data: [DONE]\n\n"),
}


def odd_server() -> FakeServer:
    srv = FakeServer({}, default=Script(chunks=[(0.0, "x", 1), (0.0, "y", 1)], prompt_tokens=3))
    normal = srv._completions

    async def completions(request):
        body = await request.json()
        if body["prompt"] not in ODD:
            return await normal(request)
        status, data = ODD[body["prompt"]]
        if status != 200:
            return web.Response(body=data, status=status, content_type="text/plain")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(data)
        await resp.write_eof()
        return resp

    srv._completions = completions  # the app routes to it when the server starts
    return srv


def test_one_odd_request_fails_alone_and_the_run_goes_on():
    prompts = ["fine", "int", "list", "badutf", "flat", "nofinish", "badusage", "fine"]
    with odd_server() as srv:
        res = run_benchmark(BenchConfig(base_url=srv.url, model="m", prompts=prompts, max_concurrency=2,
                                        output_len=4, progress=False))
    errors = dict(zip(prompts, res["errors"]))
    assert res["completed"] == 3 and res["failed"] == 5, res["errors"]
    assert errors["fine"] == "" and errors["nofinish"] == ""
    assert errors["int"] == "RuntimeError: SSE data is not a JSON object: '42'"
    assert errors["list"] == "RuntimeError: SSE data is not a JSON object: '[1,2]'"
    assert errors["badutf"].startswith("HTTP 500: \ufffd\ufffd error \ufffd")
    assert errors["flat"] == "RuntimeError: server error in stream: engine died"
    assert errors["badusage"].startswith("ValueError: invalid literal for int()")
    # [DONE] without a finish_reason anywhere: complete (vLLM's client agrees), and said so
    assert res["streams_without_finish_reason"] == 1 and res["streams_without_done"] == 0
    assert res["finish_reasons"][prompts.index("nofinish")] is None
    assert "NOTE: 1 streams ended in data: [DONE] without a finish_reason" in format_summary(res)


def test_the_report_notes_streams_without_a_finish_reason(tmp_path):
    from adaspec.bench.report import write_report

    (tmp_path / "points").mkdir()
    for r, n in enumerate((2, 0)):
        p = {"arm": "none", "concurrency": 1, "repeat": r, "complete": True, "completed": 4, "failed": 0,
             "output_throughput": 10.0 + r, "median_per_user_tok_s": 5.0 + r, "streams_without_finish_reason": n}
        (tmp_path / "points" / f"none_c1_r{r}.json").write_text(json.dumps(p))
    md = write_report(tmp_path)["markdown"]
    assert "- 2 streams ended in `data: [DONE]` without a finish_reason on any chunk" in md
