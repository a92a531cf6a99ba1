"""RequestOutputKind.NEW_TOKENS (what the server's engine process asks for): each output carries
only the tokens and logprobs its step added, and the text whole; concatenated they are exactly
the CUMULATIVE outputs of the same requests, with speculation (several tokens a step), stop
tokens and length limits, with and without async scheduling. And detokenize=False: no text at all,
the same tokens."""
import pytest

from adaspec import LLM, RequestOutputKind, SamplingParams

SPEC = {"method": "dspark", "num_speculative_tokens": 7}


def _run(llm, kind, detokenize=True):
    eng = llm.llm_engine
    eos = min(llm.get_tokenizer().eos_token_ids)
    cases = {  # seeded, so both kinds sample the same tokens
        "long": SamplingParams(temperature=1.0, seed=3, max_tokens=40, ignore_eos=True, logprobs=2),
        "stop": SamplingParams(temperature=1.0, seed=5, max_tokens=60, stop_token_ids=[eos, 300, 301, 302]),
        "greedy": SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True),
    }
    got = {}
    for rid, p in cases.items():
        p.output_kind, p.detokenize = kind, detokenize
        eng.add_request(rid, "def fib(n):", p)
        got[rid] = dict(ids=[], lps=[], texts=[], outs=0, most=0)
    while eng.has_unfinished_requests():
        for out in eng.step():
            g, comp = got[out.request_id], out.outputs[0]
            g["outs"] += 1
            g["most"] = max(g["most"], out.num_new_tokens)
            if kind is RequestOutputKind.NEW_TOKENS:
                assert len(comp.token_ids) == out.num_new_tokens
                g["ids"] += comp.token_ids
                g["lps"] += comp.logprobs or []
            else:
                g["ids"], g["lps"] = list(comp.token_ids), list(comp.logprobs or [])
            g["texts"].append(comp.text)
            g["finish"] = comp.finish_reason
    return got


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("spec", [None, SPEC])
def test_new_tokens_outputs_add_up_to_the_cumulative_ones(spec, async_scheduling):
    llm = LLM("tiny", speculative_config=spec, async_scheduling=async_scheduling)
    cumulative = _run(llm, RequestOutputKind.CUMULATIVE)
    new = _run(llm, RequestOutputKind.NEW_TOKENS)
    for rid, c in cumulative.items():
        n = new[rid]
        assert n["ids"] == c["ids"] and n["lps"] == c["lps"] and n["finish"] == c["finish"], rid
        assert n["texts"] == c["texts"] and n["outs"] == c["outs"], rid
    assert len(cumulative["long"]["ids"]) == 40 and len(cumulative["long"]["lps"]) == 40
    # the speculative runs had steps of several tokens, the plain ones none
    assert (max(n["most"] for n in new.values()) > 1) == (spec is not None)


def test_without_detokenize_the_engine_makes_the_same_tokens_and_no_text():
    llm = LLM("tiny", speculative_config=SPEC)
    with_text = _run(llm, RequestOutputKind.CUMULATIVE)
    without = _run(llm, RequestOutputKind.CUMULATIVE, detokenize=False)
    tok = llm.get_tokenizer()
    for rid, w in with_text.items():
        assert without[rid]["ids"] == w["ids"] and without[rid]["finish"] == w["finish"]
        assert set(without[rid]["texts"]) == {""}
        assert w["texts"][-1] == tok.decode(w["ids"])  # what the API server's decode ends with
