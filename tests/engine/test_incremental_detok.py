"""Incremental detokenization (tokenizers' DecodeStream) gives the text the whole-output decode
gives: at every step a prefix of it (complete characters only), and exactly it at the end."""
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
        assert stream.text == tok.decode(ids, skip_special_tokens=skip).rstrip("\ufffd")


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
