"""Each server-sent event stays one line for clients that split streams with str.splitlines()
(httpx's iter_lines does): JSON leaves U+0085, U+2028 and U+2029 raw, and one of them in generated
text once cut an event of tests/serve/test_drain.py in two."""
import json

import httpx
from hypothesis import given, strategies as st

from adaspec.serve.formatting import sse


@given(st.text())
def test_an_event_is_one_line_and_parses_back_to_the_same_text(text):
    event = sse({"choices": [{"text": text}]})
    assert event.startswith("data: ") and event.endswith("\n\n")
    body = event[len("data: "):-2]
    assert body.splitlines() == [body]
    assert json.loads(body)["choices"][0]["text"] == text


def test_httpx_reads_events_with_line_breaking_characters_whole():
    text = "a\x85b\u2028c\u2029d\u00e9\u4e2d"
    stream = sse({"text": text}) + sse({"text": "next"})
    lines = [ln for ln in httpx.Response(200, content=stream.encode()).iter_lines() if ln]
    assert [json.loads(ln[len("data: "):])["text"] for ln in lines] == [text, "next"]
