"""`--api-detokenize`: the engine makes no text for requests without stop strings
(SamplingParams.detokenize=False) and the API server decodes their tokens itself
(engine_process.ApiText). Its text must be the engine's, after every batch and at the end; the
whole HTTP behaviour on the real engine in this mode runs in test_real_engine.py."""
from __future__ import annotations

import asyncio

import pytest
from hypothesis import example, given, settings, strategies as st

from adaspec.engine.sequence import Sequence
from adaspec.engine.stop_checker import StopChecker
from adaspec.errors import InvalidRequestError
from adaspec.models.registry import resolve_model_path
from adaspec.models.tokenizer import Tokenizer
from adaspec.sampling_params import RequestOutputKind, SamplingParams
from adaspec.serve.engine_process import ApiText, EngineInfo, EngineLink
from adaspec.serve.engine_thread import ACCEPTED

TOKENIZER = Tokenizer.from_dir(resolve_model_path("tiny"))


# the tiny tokenizer's single-byte tokens of multi-byte characters (each decodes to U+FFFD alone)
PARTIAL = [i for i in range(TOKENIZER.vocab_size) if "\ufffd" in TOKENIZER.decode([i])]


def _ids(xs, multibyte):
    """0 = end of text; else token ids spread over the vocabulary, or with multibyte, odd x the bytes
    of multi-byte characters (a request may end inside one)."""
    eos = min(TOKENIZER.eos_token_ids)
    return [eos if x == 0 else PARTIAL[x % len(PARTIAL)] if multibyte and x % 2 else 200 + 97 * x % 7000
            for x in xs]


@settings(max_examples=200, deadline=None)
@given(batches=st.lists(st.lists(st.integers(0, 60), max_size=9), min_size=1, max_size=6),
       max_tokens=st.one_of(st.none(), st.integers(1, 30)), ignore_eos=st.booleans(), skip_special=st.booleans(),
       multibyte=st.booleans(), include_stop=st.booleans())
@example(batches=[[4, 1]], max_tokens=2, ignore_eos=False, skip_special=True, multibyte=True,
         include_stop=False)  # ends mid-character
@example(batches=[[4, 1], [0]], max_tokens=None, ignore_eos=False, skip_special=True, multibyte=True,
         include_stop=False)
@example(batches=[[4, 0]], max_tokens=None, ignore_eos=False, skip_special=False, multibyte=False, include_stop=False)
def test_the_api_servers_text_is_the_engines_after_every_batch(batches, max_tokens, ignore_eos, skip_special,
                                                               multibyte, include_stop):
    """The same tokens through the engine's stop checker (text in the engine) and through one with
    detokenize=False plus ApiText (text in the API server): the same tokens kept, the same finish,
    no text in the engine, and the API server's text equal to the engine's after every batch."""
    checker = StopChecker(TOKENIZER, 64)
    kw = dict(max_tokens=max_tokens, ignore_eos=ignore_eos, skip_special_tokens=skip_special,
              output_kind=RequestOutputKind.CUMULATIVE, include_stop_str_in_output=include_stop)
    engine_side = Sequence("a", None, [10, 11, 12], SamplingParams(**kw))
    api_side = Sequence("b", None, [10, 11, 12], SamplingParams(detokenize=False, **kw))
    text_of = ApiText(TOKENIZER, skip_special, include_stop)
    for batch in batches:
        if engine_side.finish_reason is not None:
            break
        sent = len(api_side.output_token_ids)
        assert checker.append(engine_side, _ids(batch, multibyte)) == checker.append(api_side, _ids(batch, multibyte))
        assert api_side.token_ids == engine_side.token_ids
        assert api_side.finish_reason == engine_side.finish_reason
        assert api_side.output_text == ""  # the engine made none
        assert text_of.text(api_side.output_token_ids[sent:], api_side.finish_reason) == engine_side.output_text


def test_stop_strings_need_the_text_in_the_engine():
    with pytest.raises(InvalidRequestError, match="stop strings need detokenize=True") as e:
        SamplingParams(stop=["\n"], detokenize=False)
    assert e.value.param == "stop"
    assert SamplingParams(detokenize=False).detokenize is False


class _Pipe:
    def __init__(self):
        self.sent = []

    def send(self, msg):
        self.sent.append(msg)


class _Link(EngineLink):
    def _engine_alive(self):
        return True


@pytest.mark.parametrize("api_detokenize, stop, engine_decodes", [
    (True, [], False), (True, ["\n"], True), (False, [], True)])
def test_the_link_sends_detokenize_false_only_for_requests_it_can_decode(api_detokenize, stop, engine_decodes):
    """With api_detokenize a request without stop strings goes to the engine with detokenize=False
    (a copy: the caller's params are untouched) and its route decodes; one with stop strings, or
    any request without api_detokenize, leaves the text to the engine."""
    link = _Link(_Pipe(), api_detokenize=api_detokenize)
    link.engine = EngineInfo(TOKENIZER, 256, "tiny")
    params = SamplingParams(max_tokens=4, stop=stop)

    async def add():
        task = asyncio.ensure_future(link.add("r1", [10, 11], params, 0.0, 2))
        await asyncio.sleep(0)
        link._routes["r1"].queue.put_nowait(ACCEPTED)
        return await task

    asyncio.run(add())
    (kind, rid, _, sent_params, _), = link._conn.sent
    assert (kind, rid) == ("add", "r1")
    assert sent_params.detokenize is engine_decodes and params.detokenize is True
    assert (link._routes["r1"].text_of is None) is engine_decodes
