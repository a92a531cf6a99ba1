"""The server on the real LLMEngine and a random micro model: its greedy text equals LLM.generate."""
from __future__ import annotations

import asyncio
import functools
import json

import httpx
import pytest
from live_server import LiveServer, openai_client, request_counts

pytest.importorskip("torch")
testing = pytest.importorskip("adaspec.testing")

ENGINE_ARGS = dict(max_num_seqs=64, num_kv_blocks=512, block_size=16, max_model_len=512, device="cpu")
PROMPTS = ["def fib(n):", "The quick brown fox", "import os\nimport sys\n"]
CHATS = [[{"role": "user", "content": "hello"}],
         [{"role": "system", "content": "be brief"}, {"role": "user", "content": "for i in range(10):"}]]


@pytest.fixture(scope="module")
def micro_dir(tmp_path_factory):
    return str(testing.make_micro_model_dir(tmp_path_factory.mktemp("serve_micro") / "micro"))


@pytest.fixture(scope="module")
def reference(micro_dir):
    from adaspec import LLM, SamplingParams

    llm = LLM(micro_dir, **ENGINE_ARGS)

    def generate(prompt, max_tokens, **kw):  # one prompt at a time, as the server gets them in these tests
        return llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw))[0]

    generate.tokenizer = llm.get_tokenizer()
    return generate


@pytest.fixture(scope="module", params=["thread", "process", "process-api-detokenize"])
def real_server(micro_dir, request):
    """The engine in a thread of the server, in a process of its own (--engine-process), and so with
    the text decoded by the API server (--api-detokenize)."""
    from adaspec.config import EngineConfig
    from adaspec.serve.cli import build_engine

    s = LiveServer(functools.partial(build_engine, EngineConfig(model=micro_dir, **ENGINE_ARGS)), names=("micro",),
                   engine_process=request.param != "thread", api_detokenize=request.param == "process-api-detokenize")
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(real_server):
    return openai_client(real_server)


def test_logits_rules_reach_the_engine(client, reference):
    """Penalties, logit_bias (token ids as strings; clamped to +-100 as vLLM), min_tokens, allowed
    ids: the server's text is LLM.generate's with the same rules, and the rules change it."""
    rules = dict(presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.3, min_tokens=6)
    plain = reference(PROMPTS[0], 16, ignore_eos=True)
    top = plain.outputs[0].token_ids[0]
    ref = reference(PROMPTS[0], 16, ignore_eos=True, logit_bias={top: -100.0}, **rules)
    r = client.completions.create(model="micro", prompt=PROMPTS[0], max_tokens=16, temperature=0, logit_bias={str(top): -500},
                                  presence_penalty=1.0, frequency_penalty=0.5,
                                  extra_body={"ignore_eos": True, "repetition_penalty": 1.3, "min_tokens": 6})
    assert r.choices[0].text == ref.outputs[0].text != plain.outputs[0].text
    allowed = sorted(set(plain.outputs[0].token_ids[:3]))
    ref = reference(PROMPTS[1], 8, ignore_eos=True, allowed_token_ids=allowed)
    r = client.chat.completions.create(model="micro", messages=CHATS[0], max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True, "allowed_token_ids": allowed})
    assert r.choices[0].message.content is not None and r.usage.completion_tokens == 8
    r = client.completions.create(model="micro", prompt=PROMPTS[1], max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True, "allowed_token_ids": allowed})
    assert r.choices[0].text == ref.outputs[0].text
    word = reference.tokenizer.decode([top])  # the first token's text: banned, the text changes
    ref = reference(PROMPTS[0], 16, ignore_eos=True, bad_words=[word])
    r = client.completions.create(model="micro", prompt=PROMPTS[0], max_tokens=16, temperature=0,
                                  extra_body={"ignore_eos": True, "bad_words": [word]})
    assert r.choices[0].text == ref.outputs[0].text != plain.outputs[0].text


def test_completion_top_logprobs_hold_the_sampled_token(client):
    """OpenAI's completions: "the API will always return the logprob of the sampled token, so there
    may be up to logprobs+1 elements" (vLLM's too): logprobs=0 gives the sampled token alone, and a
    sampled token outside the top n is an entry beside them (it was left out)."""
    r = client.completions.create(model="micro", prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=0)
    lp = r.choices[0].logprobs
    assert [list(d) for d in lp.top_logprobs] == [[t] for t in lp.tokens]
    assert [d[t] for d, t in zip(lp.top_logprobs, lp.tokens)] == lp.token_logprobs
    r = client.completions.create(model="micro", prompt=PROMPTS[0], max_tokens=40, temperature=5.0, seed=3,
                                  logprobs=1, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert all(t in d and 1 <= len(d) <= 2 for d, t in zip(lp.top_logprobs, lp.tokens))
    assert any(len(d) == 2 for d in lp.top_logprobs), "at T = 5 some sampled token is not the likeliest"


def test_echo_and_prompt_logprobs_match_llm_generate(client, real_server, reference):
    """Completions' echo (the prompt's text, tokens and logprobs before the completion's; the first
    token's logprob null), echo with max_tokens 0 (the prompt alone), and vLLM's prompt_logprobs
    field, streamed and not: the values are LLM.generate's prompt_logprobs."""
    prompt = PROMPTS[2]
    ref = reference(prompt, 4, logprobs=2, prompt_logprobs=2)
    ids, P = ref.prompt_token_ids, len(ref.prompt_token_ids)
    want = [None] + [float(ref.prompt_logprobs[p][ids[p]]) for p in range(1, P)]
    r = client.completions.create(model="micro", prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=2)
    ch = r.choices[0]
    assert ch.text == prompt + ref.outputs[0].text
    got = ch.logprobs.token_logprobs
    assert len(got) == P + 4 and got[0] is None and ch.logprobs.top_logprobs[0] is None
    assert all(abs(g - w) < 1e-4 for g, w in zip(got[1:P], want[1:]))
    assert all(abs(g - float(d[t])) < 1e-4 for g, t, d in zip(got[P:], ref.outputs[0].token_ids, ref.outputs[0].logprobs))
    alone = client.completions.create(model="micro", prompt=prompt, max_tokens=0, temperature=0, echo=True, logprobs=1)
    assert alone.choices[0].text == prompt and alone.usage.completion_tokens == 0
    assert len(alone.choices[0].logprobs.token_logprobs) == P
    streamed = client.completions.create(model="micro", prompt=prompt, max_tokens=4, temperature=0, echo=True,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == prompt + ref.outputs[0].text
    for stream in (False, True):
        body = httpx.post(real_server.url + "/v1/completions", json={
            "prompt": prompt, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2, "stream": stream}, timeout=30)
        assert body.status_code == 200, body.text
        if stream:
            events = [line[6:] for line in body.text.splitlines() if line.startswith("data: {")]
            plps = next(e["choices"][0]["prompt_logprobs"] for e in map(json.loads, events)
                        if e["choices"] and "prompt_logprobs" in e["choices"][0])
        else:
            plps = body.json()["choices"][0]["prompt_logprobs"]
        assert plps[0] is None and len(plps) == P
        for p in range(1, P):
            entry = plps[p][str(ids[p])]
            assert abs(entry["logprob"] - want[p]) < 1e-4 and entry["rank"] == ref.prompt_logprobs[p][ids[p]].rank
    chat = httpx.post(real_server.url + "/v1/chat/completions", json={
        "messages": CHATS[0], "max_tokens": 2, "temperature": 0, "prompt_logprobs": 1}, timeout=30).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    refused = httpx.post(real_server.url + "/v1/chat/completions", json={
        "messages": CHATS[0], "max_tokens": 2, "prompt_logprobs": 1, "stream": True}, timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"
    # an explicit prompt_logprobs wins over logprobs under echo (vLLM): 0 -> the prompt token alone
    r = httpx.post(real_server.url + "/v1/completions", json={
        "prompt": prompt, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 2, "prompt_logprobs": 0},
        timeout=30).json()
    assert [len(t) for t in r["choices"][0]["prompt_logprobs"][1:]] == [1] * (P - 1)
    # echo without generation, streamed with continuous usage: no chunk counts the hidden token
    body = httpx.post(real_server.url + "/v1/completions", json={
        "prompt": prompt, "max_tokens": 0, "echo": True, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}, timeout=30)
    events = [json.loads(line[6:]) for line in body.text.splitlines() if line.startswith("data: {")]
    assert all(e["usage"]["completion_tokens"] == 0 for e in events if e.get("usage"))
    # truncate_prompt_tokens with echo: the tokens kept are the prompt echoed
    r = client.completions.create(model="micro", prompt=ids, max_tokens=1, temperature=0, echo=True,
                                  extra_body={"truncate_prompt_tokens": 3})
    assert r.choices[0].text.startswith(reference.tokenizer.decode(ids[-3:])) and r.usage.prompt_tokens == 3


def test_truncate_prompt_tokens_keeps_the_last_tokens(client, reference):
    """vLLM's truncate_prompt_tokens: a prompt longer than the context fits once cut to its last k."""
    ids = [3 + i % 300 for i in range(700)]  # more than max_model_len 512
    r = client.completions.create(model="micro", prompt=ids, max_tokens=4, temperature=0,
                                  extra_body={"truncate_prompt_tokens": 20})
    assert r.usage.prompt_tokens == 20
    assert r.choices[0].text == reference(ids[-20:], 4).outputs[0].text


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_greedy_equals_llm_generate(client, reference, prompt):
    ref = reference(prompt, 24)
    r = client.completions.create(model="micro", prompt=prompt, max_tokens=24, temperature=0)
    assert r.choices[0].text == ref.outputs[0].text
    assert r.choices[0].finish_reason == ref.outputs[0].finish_reason
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


@pytest.mark.parametrize("prompt", PROMPTS)
def test_streamed_completion_concatenates_to_non_streamed(client, prompt):
    full = client.completions.create(model="micro", prompt=prompt, max_tokens=24, temperature=0)
    chunks = list(client.completions.create(model="micro", prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()
    assert chunks[-2].choices[0].finish_reason == full.choices[0].finish_reason


@pytest.mark.parametrize("messages", CHATS)
def test_chat_greedy_equals_llm_generate(client, reference, messages):
    ref = reference(reference.tokenizer.apply_chat_template(messages), 20)
    r = client.chat.completions.create(model="micro", messages=messages, max_tokens=20, temperature=0)
    assert r.choices[0].message.content == ref.outputs[0].text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)
    stream = client.chat.completions.create(model="micro", messages=messages, max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.outputs[0].text
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_stop_string_never_leaks_partial_matches_into_the_stream(client, reference):
    text = reference("x", 40).outputs[0].text
    stop = "2222"  # the micro model (seed 0) repeats "2" after "x": partial matches "2".."222" come first
    if stop not in text:
        pytest.skip("the micro model's output changed; pick another stop string")
    expected = text[: text.index(stop)]
    chunks = list(client.completions.create(model="micro", prompt="x", max_tokens=40, temperature=0, stop=[stop],
                                            stream=True))
    sent = ""
    for c in chunks:
        sent += c.choices[0].text
        assert expected.startswith(sent)  # nothing beyond the text before the stop string, ever
    assert sent == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_prompt_too_long_is_400(real_server):
    r = httpx.post(real_server.url + "/v1/completions", json={"prompt": list(range(5, 600)), "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


async def _stream(client: httpx.AsyncClient, url, i, max_tokens, disconnect_after=None):
    body = {"model": "micro", "prompt": f"{PROMPTS[i % 3]} {i}", "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    n = 0
    async with client.stream("POST", url, json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                n += 1
                if disconnect_after is not None and n >= disconnect_after:
                    return "disconnected"  # leaving the block closes the connection mid-stream
                if line == "data: [DONE]":
                    return "done"
    return "eof"


def test_64_concurrent_streams_and_20_disconnects_free_every_kv_block(real_server):
    url = real_server.url + "/v1/completions"

    async def main():
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=60, limits=limits) as c:
            done = [_stream(c, url, i, 16) for i in range(64)]
            cut = [_stream(c, url, i, 400, disconnect_after=3) for i in range(20)]
            return await asyncio.gather(*done, *cut)

    results = asyncio.run(main())
    assert results[:64] == ["done"] * 64
    assert results[64:] == ["disconnected"] * 20
    free, total = real_server.wait_idle(timeout=20)
    assert free == total
    assert real_server.engine(request_counts) == (0, 0, False)
    assert real_server.state.inflight == 0
    r = httpx.post(url, json={"model": "micro", "prompt": "still there?", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert httpx.get(real_server.url + "/health").status_code == 200


def _metric(url, name, **labels):
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def test_speculative_server_is_greedy_lossless_and_reports_spec_metrics(micro_dir, reference, tmp_path):
    from adaspec.config import EngineConfig
    from adaspec.engine.llm_engine import LLMEngine

    drafter = str(testing.make_micro_drafter_dir(tmp_path / "drafter", micro_dir))
    spec = {"method": "dspark", "model": drafter, "num_speculative_tokens": 3}
    s = LiveServer(lambda: LLMEngine(EngineConfig(model=micro_dir, speculative_config=spec, **ENGINE_ARGS)),
                   names=("micro",))
    try:
        c = openai_client(s)
        for prompt in PROMPTS[:2]:
            r = c.completions.create(model="micro", prompt=prompt, max_tokens=16, temperature=0)
            assert r.choices[0].text == reference(prompt, 16).outputs[0].text
        s.wait_idle()
        assert _metric(s.url, "adaspec:spec_decode_num_drafts_total") > 0
        assert _metric(s.url, "adaspec:spec_decode_num_draft_tokens_total") > 0
        assert _metric(s.url, "adaspec:spec_decode_num_verified_tokens_total") > 0
        assert _metric(s.url, "adaspec:spec_decode_budget_steps_total") > 0
        # calibration view per position: verified >= accepted, predicted survival is a positive sum
        verified0 = _metric(s.url, "adaspec:spec_decode_num_verified_tokens_per_pos_total", position="0")
        assert verified0 > 0
        assert _metric(s.url, "adaspec:spec_decode_num_accepted_tokens_per_pos_total", position="0") <= verified0
        assert 0 < _metric(s.url, "adaspec:spec_decode_predicted_accepted_tokens_per_pos_total", position="0") <= verified0
        assert _metric(s.url, "adaspec:generation_tokens_total") == 32
        assert _metric(s.url, "adaspec:request_success_total", finished_reason="length") == 2
    finally:
        s.close()


def test_chat_template_rejection_is_400(micro_dir, tmp_path):
    # a tokenizer_config template that refuses a system message, as some real ones do
    import json
    import shutil

    from adaspec.config import EngineConfig
    from adaspec.engine.llm_engine import LLMEngine

    model = tmp_path / "strict"
    shutil.copytree(micro_dir, model)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["chat_template"] = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                            "{{ raise_exception('System role not supported') }}{% endif %}"
                            "{{ m['content'] }}{% endfor %}")
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    s = LiveServer(lambda: LLMEngine(EngineConfig(model=str(model), **ENGINE_ARGS)), names=("strict",))
    try:
        r = httpx.post(s.url + "/v1/chat/completions",
                       json={"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}]})
        assert r.status_code == 400, r.text
        assert "System role not supported" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "messages"
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "y"}],
                                                             "max_tokens": 2})
        assert r.status_code == 200
    finally:
        s.close()


def test_params_spoiled_after_construction_fail_that_request_alone(real_server):
    """SamplingParams are mutable: one changed after it was validated is refused by the engine (or
    by the server's own copy of it) as a 400 naming the field, and the engine keeps serving."""
    import time

    from adaspec import SamplingParams
    from adaspec.errors import InvalidRequestError

    bad = SamplingParams(max_tokens=2)
    bad.temperature = -1.0

    async def add(rid, params):  # the bound is on a hang only (an engine thread that died never answers)
        return await asyncio.wait_for(real_server.engine_thread.add(rid, [10, 11], params, time.monotonic(), 2), 60)

    with pytest.raises(InvalidRequestError, match="temperature") as e:
        asyncio.run(add("spoiled", bad))
    assert e.value.param == "temperature"
    r = httpx.post(real_server.url + "/v1/completions", json={"model": "micro", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 200


def test_n_seeded_samples_equal_single_requests_with_seed_plus_index(client):
    """The server's n samples (seed s) are what requests of one sample with seeds s, s + 1 give."""
    r = client.completions.create(model="micro", prompt=PROMPTS[0], max_tokens=12, temperature=1.0, seed=7, n=2)
    singles = [client.completions.create(model="micro", prompt=PROMPTS[0], max_tokens=12, temperature=1.0, seed=7 + j)
               for j in range(2)]
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [s.choices[0].text for s in singles]
    assert r.choices[0].text != r.choices[1].text
    assert r.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    assert r.usage.prompt_tokens == singles[0].usage.prompt_tokens


def test_structured_outputs_reach_the_engine(client, reference):
    """response_format (json_schema, json_object), vLLM's structured_outputs and guided_* fields:
    the server's text is LLM.generate's under the same constraint, streamed or not; a constraint
    that does not compile is a 400 with llguidance's reason, and the server goes on."""
    from adaspec.sampling_params import StructuredOutputsParams as SO

    schema = {"type": "object", "properties": {"a": {"enum": ["x", "yz"]}}, "required": ["a"],
              "additionalProperties": False}
    chat_ref = reference(reference.tokenizer.apply_chat_template(CHATS[0], add_generation_prompt=True), 40,
                         structured_outputs=SO(json=schema))
    r = client.chat.completions.create(model="micro", messages=CHATS[0], max_tokens=40, temperature=0,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "a", "schema": schema}})
    assert r.choices[0].message.content == chat_ref.outputs[0].text
    if r.choices[0].finish_reason == "stop":
        assert json.loads(r.choices[0].message.content)["a"] in ("x", "yz")
    cases = [({"structured_outputs": {"regex": "[a-c]{2,6}!"}}, SO(regex="[a-c]{2,6}!")),
             ({"guided_choice": ["alpha", "beta"]}, SO(choice=["alpha", "beta"])),
             ({"response_format": {"type": "json_object"}}, SO(json_object=True))]
    for body, so in cases:
        ref = reference(PROMPTS[0], 24, structured_outputs=so).outputs[0].text
        r = client.completions.create(model="micro", prompt=PROMPTS[0], max_tokens=24, temperature=0, extra_body=body)
        assert r.choices[0].text == ref, body
        streamed = client.completions.create(model="micro", prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                             stream=True, extra_body=body)
        assert "".join(c.choices[0].text for c in streamed if c.choices) == ref, body
    assert ref.startswith("{")
    bad = httpx.post(f"{client.base_url}completions", json={"model": "micro", "prompt": "x", "max_tokens": 4,
                                                            "structured_outputs": {"regex": "(("}})
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["param"] == "structured_outputs" and "unclosed group" in bad.json()["error"]["message"]
    r = client.completions.create(model="micro", prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                  extra_body={"guided_choice": ["alpha", "beta"]})
    assert r.choices[0].text in ("alpha", "beta")
