"""Incremental detokenization (tokenizers' DecodeStream) gives the text the whole-output decode
gives: at every step a prefix of it (complete characters only), and exactly it at the end when the
output ends on a complete character. A last token that ends inside a character (e.g. the tiny
tokenizer's 5918, a space and two bytes of a three-byte character) stays held back whole, space
included: the stream emits no part of a token; a finished request's text is the whole decode
(engine/stop_checker.py), which the engine test below checks."""
import pytest
from hypothesis import given, settings, strategies as st

from adaspec import LLM, SamplingParams
from adaspec.models.registry import resolve_model_path
from adaspec.models.tokenizer import Tokenizer
from adaspec.testing import make_micro_model_dir


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    micro = make_micro_model_dir(tmp_path_factory.mktemp("micro"))
    return [Tokenizer.from_dir(resolve_model_path("tiny")), Tokenizer.from_dir(micro)]


@settings(max_examples=60, deadline=None)
@given(data=st.data(), skip=st.booleans())
def test_stream_text_is_a_prefix_of_the_whole_decode(tokenizers, data, skip):
    for tok in tokenizers:
        vocab = tok._tok.get_vocab_size()
        ids = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=40))
        stream = tok.decode_stream(skip_special_tokens=skip)
        for n, i in enumerate(ids, 1):
            text = stream.step(i)
            whole = tok.decode(ids[:n], skip_special_tokens=skip)
            assert whole.startswith(text), (ids[:n], text, whole)
            assert len(whole.rstrip("\ufffd")) - len(text) <= 4  # at most one unfinished character behind
        whole = tok.decode(ids, skip_special_tokens=skip)
        if not whole.endswith("\ufffd"):
            assert stream.text == whole


def test_a_last_token_that_ends_inside_a_character_is_held_back_whole():
    tok = Tokenizer.from_dir(resolve_model_path("tiny"))
    stream = tok.decode_stream(skip_special_tokens=True)
    assert stream.step(5918) == "" and tok.decode([5918]) == " \ufffd"


def test_engine_text_equals_whole_decode_and_streams_as_prefixes():
    llm = LLM("tiny")
    eng, tok = llm.llm_engine, llm.get_tokenizer()
    params = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, seed=7)
    eng.add_request("a", "def fib(n):", params)
    seen = []
    while eng.has_unfinished_requests():
        for out in eng.step():
            seen.append(out.outputs[0].text)
    final = out.outputs[0]
    assert final.text == tok.decode(final.token_ids)
    assert all(b.startswith(a) for a, b in zip(seen, seen[1:]))


def test_final_only_reports_a_request_once_and_generate_is_unchanged():
    from adaspec import RequestOutputKind

    llm = LLM("tiny")
    eng = llm.llm_engine
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = llm.generate(["x = 1"], p)[0].outputs[0].token_ids
    eng.add_request("f", "x = 1", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                  output_kind=RequestOutputKind.FINAL_ONLY))
    eng.add_request("c", "x = 1", p)
    reported = {"f": 0, "c": 0}
    while eng.has_unfinished_requests():
        for out in eng.step():
            reported[out.request_id] += 1
            if out.request_id == "f":
                assert out.finished and out.outputs[0].token_ids == want
    assert reported["f"] == 1 and reported["c"] > 1


@pytest.mark.parametrize("spec", [None, {"method": "dspark", "num_speculative_tokens": 3}])
def test_final_only_text_is_decoded_once_at_the_end_and_equals_the_streamed_text(spec):
    """A final-only request without stop strings is not detokenized token by token (its text is
    read only when it ends): no incremental decoder, empty text while it runs, and at the end the
    text a cumulative request gets. An abort still reports the text made so far."""
    from adaspec import RequestOutputKind

    llm = LLM("tiny", speculative_config=spec)
    eng, tok = llm.llm_engine, llm.get_tokenizer()
    final = RequestOutputKind.FINAL_ONLY
    kw = dict(temperature=1.0, max_tokens=30, ignore_eos=True, seed=3)
    eng.add_request("f", "def fib(n):", SamplingParams(**kw, output_kind=final))
    eng.add_request("c", "def fib(n):", SamplingParams(**kw))
    eng.add_request("s", "def fib(n):", SamplingParams(**kw, output_kind=final, stop=["never-seen"]))
    eng.add_request("a", "import os", SamplingParams(**kw, output_kind=final))
    outs = {}
    steps = 0
    while eng.has_unfinished_requests():
        steps += 1
        f = eng.requests.get("f")
        if f is not None and f.finish_reason is None:
            assert f.text_stream is None and f.output_text == ""
        if steps == 3:
            a = eng.requests["a"]
            assert a.output_token_ids and a.output_text == ""
            eng.abort_request("a")
            want_abort = tok.decode(a.output_token_ids)
        for out in eng.step():
            if out.finished:
                outs[out.request_id] = out.outputs[0]
    assert outs["f"].token_ids == outs["c"].token_ids == outs["s"].token_ids
    assert outs["f"].text == outs["c"].text == outs["s"].text == tok.decode(outs["f"].token_ids) != ""
    assert outs["a"].finish_reason == "abort" and outs["a"].text == want_abort != ""
