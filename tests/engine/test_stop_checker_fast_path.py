"""The stop checker's whole-list path (requests without stop strings, logprobs or a text stream)
ends every request exactly where the token-by-token path does: same tokens kept, same finish
reason and stop reason, same count, same final text."""
import pytest
from hypothesis import example, given, settings, strategies as st

from adaspec.engine.sequence import Sequence
from adaspec.engine.stop_checker import StopChecker
from adaspec.models.registry import resolve_model_path
from adaspec.models.tokenizer import Tokenizer
from adaspec.sampling_params import RequestOutputKind, SamplingParams

EOS = 2


def _seq(prompt_len, generated, params):
    seq = Sequence("r", None, list(range(10, 10 + prompt_len)), params)
    seq.token_ids.extend(generated)
    return seq


def _both(checker, prompt_len, generated, tokens, params):
    fast, slow = _seq(prompt_len, generated, params), _seq(prompt_len, generated, params)
    n_fast = checker.append(fast, list(tokens))
    n_slow = checker._append_each(slow, list(tokens), None)
    return (n_fast, fast), (n_slow, slow)


@settings(max_examples=400, deadline=None)
@given(prompt_len=st.integers(1, 6), generated=st.lists(st.integers(0, 6), max_size=5),
       tokens=st.lists(st.integers(0, 6), max_size=9), max_tokens=st.one_of(st.none(), st.integers(1, 12)),
       max_model_len=st.integers(2, 24), ignore_eos=st.booleans(), stops=st.lists(st.integers(2, 6), max_size=2))
def test_the_whole_list_path_ends_where_the_token_by_token_path_does(prompt_len, generated, tokens, max_tokens,
                                                                       max_model_len, ignore_eos, stops):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, stop_token_ids=stops,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    checker = StopChecker(None, max_model_len, eos_token_ids={EOS})
    (n_fast, fast), (n_slow, slow) = _both(checker, prompt_len, generated, tokens, params)
    assert n_fast == n_slow
    assert fast.token_ids == slow.token_ids
    assert (fast.finish_reason, fast.stop_reason) == (slow.finish_reason, slow.stop_reason)


@pytest.mark.parametrize("tokens, want", [([5, EOS, 5], "stop"), ([5, 5, 5, 5, 5, 5], "length"), ([5], None)])
def test_a_final_only_request_gets_its_whole_text_once_it_ends(tokens, want):
    tok = Tokenizer.from_dir(resolve_model_path("tiny"))
    eos = min(tok.eos_token_ids)
    tokens = [eos if t == EOS else 300 + t for t in tokens]
    params = SamplingParams(max_tokens=4, output_kind=RequestOutputKind.FINAL_ONLY)
    checker = StopChecker(tok, 64)
    (n_fast, fast), (n_slow, slow) = _both(checker, 3, [], tokens, params)
    assert (n_fast, fast.finish_reason, fast.output_text) == (n_slow, slow.finish_reason, slow.output_text)
    assert fast.finish_reason == want
    assert (fast.output_text != "") == (want is not None)  # decoded at the end only


@pytest.mark.parametrize("kind", [RequestOutputKind.FINAL_ONLY, RequestOutputKind.CUMULATIVE])
@pytest.mark.parametrize("include", [False, True])
def test_the_token_that_stops_a_request_is_no_part_of_its_text(kind, include):
    """As vLLM: an end-of-sequence or stop token ends the request and is kept in its tokens, but
    its text is not in the output (with skip_special_tokens off too) unless
    include_stop_str_in_output."""
    tok = Tokenizer.from_dir(resolve_model_path("tiny"))
    eos, word, stop = min(tok.eos_token_ids), tok.encode("hello")[0], tok.encode(" world")[0]
    checker = StopChecker(tok, 64)
    for last, params in ((eos, dict(skip_special_tokens=False)), (stop, dict(stop_token_ids=[stop]))):
        seq = _seq(3, [], SamplingParams(output_kind=kind, include_stop_str_in_output=include, **params))
        checker.append(seq, [word, last, word])
        assert seq.output_token_ids == [word, last] and seq.finish_reason == "stop"
        assert seq.output_text == tok.decode([word, last] if include else [word], skip_special_tokens=False)


# " é" in the tiny tokenizer: a space, then the two bytes of "é" as two tokens (the first alone
# decodes to U+FFFD); "世" is three byte tokens
_PIECES = {"sp": [224], "e1": [131], "e2": [106], "x": [300], "w1": [142], "w2": [120], "w3": [248]}


@settings(max_examples=150, deadline=None)
@given(pieces=st.lists(st.sampled_from(sorted(_PIECES)), min_size=1, max_size=14),
       stops=st.lists(st.sampled_from(["é é", "é", " é", "é x", "世"]), min_size=1, max_size=2),
       chunk=st.integers(1, 3))
@example(pieces=["sp", "e1", "e2", "sp", "e1", "e2"], stops=["é é"], chunk=1)  # ' é \ufffd' held nothing back
def test_streamed_text_with_stop_strings_only_grows(pieces, stops, chunk):
    """A client shown a request's text step by step never sees text taken back: what may still
    become a stop string is held back even while the text ends in half a character (the held tail
    was once measured before the half character was stripped, so ' é' went out, then ' ')."""
    tok = Tokenizer.from_dir(resolve_model_path("tiny"))
    assert tok.decode([224, 131, 106]) == " é" and tok.decode([224, 131]).endswith("\ufffd")
    ids = [t for p in pieces for t in _PIECES[p]]
    params = SamplingParams(max_tokens=64, stop=stops, ignore_eos=True, output_kind=RequestOutputKind.CUMULATIVE)
    seq, checker, shown = _seq(3, [], params), StopChecker(tok, 256), ""
    for i in range(0, len(ids), chunk):  # several tokens a step, as speculative steps append
        checker.append(seq, ids[i:i + chunk])
        assert seq.output_text.startswith(shown), (shown, seq.output_text)
        shown = seq.output_text
        if seq.finish_reason is not None:
            break
    whole = tok.decode(ids)
    if seq.finish_reason is None:  # no stop string in it: all but a possible stop's start is shown
        assert not any(s in whole for s in stops) and whole.startswith(shown)
    else:  # cut before the first stop string
        assert shown == whole[: min(whole.find(s) for s in stops if s in whole)]


@pytest.mark.parametrize("plain", [True, False])  # the whole-list path, and the token-by-token one (logprobs)
@pytest.mark.parametrize("ignore_eos, stops, want", [
    (False, [], None),  # as vLLM: an end of sequence ends it with no stop_reason
    (False, [EOS], None),  # the end of sequence is checked first
    (True, [EOS], EOS),  # ignored, it is one of the stop tokens
    (False, [5], 5),
])
def test_stop_reason_is_the_stop_token_and_none_for_an_end_of_sequence(plain, ignore_eos, stops, want):
    params = SamplingParams(max_tokens=10, ignore_eos=ignore_eos, stop_token_ids=stops,
                            logprobs=None if plain else 0, output_kind=RequestOutputKind.FINAL_ONLY)
    seq = _seq(2, [], params)
    StopChecker(None, 64, eos_token_ids={EOS}).append(seq, [4, 5 if stops == [5] else EOS, 6])
    assert (seq.finish_reason, seq.stop_reason, seq.output_token_ids) == ("stop", want, [4, seq.output_token_ids[1]])
