"""Logits rules (sample/logits_rules.py): penalties, logit_bias, min_tokens, min_p,
allowed_token_ids and bad_words, against a brute-force reference written from vLLM's definitions, then through
the engine (plain, async, speculative, graphed) and the server's fields."""
import dataclasses
import math
from collections import Counter

import pytest
import torch

from adaspec import LLM, SamplingParams
from adaspec.errors import InvalidRequestError
from adaspec.sample import logits_rules
from adaspec.sample.logits_rules import LogitsRule, RuleRow, apply_logits_rules, bad_word_ids
from adaspec.testing import no_eager_decodes, pin_cost_tables, use_eager_spec_graphs

INF = float("inf")


def reference_row(x: list[float], p: SamplingParams, prompt: list[int], output: list[int], eos: set[int],
                  bad: tuple = ()) -> list[float]:
    """One row, token by token, in vLLM V1's order (its Sampler's docstring): allowed_token_ids,
    bad words (bad: their token ids), logit_bias, min_tokens, repetition / frequency / presence
    penalties; min_p after temperature."""
    V = len(x)
    x = list(x)
    if p.allowed_token_ids is not None:
        x = [v if t in p.allowed_token_ids else -INF for t, v in enumerate(x)]
    for word in bad:  # its last token, where the output ends with the rest of it
        if len(word) - 1 <= len(output) and tuple(output[len(output) - len(word) + 1:]) == tuple(word[:-1]):
            x[word[-1]] = -INF
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    if len(output) < p.min_tokens:  # vLLM's all_stop_token_ids: the end of sequence even with ignore_eos
        for t in set(p.stop_token_ids) | eos:
            x[t] = -INF
    counts = Counter(output)
    for t in range(V):
        if p.repetition_penalty != 1 and (t in prompt or counts[t]):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        x[t] -= p.frequency_penalty * counts[t] + p.presence_penalty * (counts[t] > 0)
    if p.min_p > 0 and not p.greedy:
        e = [math.exp((v - max(x)) / p.temperature) if v > -INF else 0.0 for v in x]
        x = [v if e[t] >= p.min_p * max(e) else -INF for t, v in enumerate(x)]
    return x


def _random_params(g: torch.Generator, V: int) -> SamplingParams:
    def coin():
        return torch.rand((), generator=g).item() < 0.5

    def uni(lo, hi):
        return lo + (hi - lo) * torch.rand((), generator=g).item()

    ids = lambda n: torch.randperm(V, generator=g)[:n].tolist()  # noqa: E731
    return SamplingParams(
        temperature=0.0 if coin() and coin() else uni(0.3, 1.5), max_tokens=50,
        presence_penalty=uni(-2, 2) if coin() else 0.0, frequency_penalty=uni(-2, 2) if coin() else 0.0,
        repetition_penalty=uni(0.5, 2) if coin() else 1.0, min_tokens=int(uni(0, 8)) if coin() else 0,
        min_p=uni(0, 0.5) if coin() else 0.0, logit_bias={t: uni(-5, 5) for t in ids(3)} if coin() else None,
        allowed_token_ids=ids(V // 2) if coin() and coin() else None, stop_token_ids=ids(2), ignore_eos=coin())


@pytest.mark.parametrize("sparse", [True, False], ids=["sparse-penalties", "dense-penalties"])
def test_rules_match_the_brute_force_reference(sparse, monkeypatch):
    """Random rules on random logits (with zeros and negatives, so the repetition penalty's two
    branches both run), random histories, drafts after them and pending device tokens; with the
    penalties applied to the histories' tokens only (the CPU's way) and to every logit (CUDA's)."""
    monkeypatch.setattr(logits_rules, "_sparse_penalties", lambda device: sparse)
    g = torch.Generator().manual_seed(0)
    V, eos = 40, {3}
    rows, want, pending_tokens = [], [], []
    logits = torch.randn(60, V, generator=g) * 3
    logits[:, 5] = 0.0
    for i in range(60):
        p = _random_params(g, V)
        rule = LogitsRule.of(p, eos, V)
        bad = ()
        if i % 5 == 2:  # bad words (token ids: the tokenization is bad_word_ids' job), some matching the history
            bad = ((7,), (8, 9), (10, 11, 12), (13, 14))
            rule = dataclasses.replace(rule or LogitsRule.of(SamplingParams(presence_penalty=0.1), eos, V), bad_words=bad)
        if rule is None or i % 10 == 0:
            rows.append(None)
            want.append(logits[i].tolist())
            continue
        prompt = torch.randint(0, V, (int(torch.randint(1, 12, (), generator=g)),), generator=g).tolist()
        output = torch.randint(0, V, (int(torch.randint(0, 10, (), generator=g)),), generator=g).tolist()
        if bad:
            output += [[10, 11], [8], [13], [12]][i % 4]
        extra = output[-2:] if i % 3 == 0 else []  # drafts before a verification position
        pend = -1
        if i % 4 == 1 and not extra:  # its last output token still on the device
            pend = len(pending_tokens)
            pending_tokens.append(output.pop() if bad else int(torch.randint(0, V, (), generator=g)))
        rows.append(RuleRow(rule, 0.0 if p.greedy else p.temperature, prompt, output, extra, pend))
        full = output + ([pending_tokens[pend]] if pend >= 0 else []) + extra
        want.append(reference_row(logits[i].tolist(), p, prompt, full, eos, bad))
    got = apply_logits_rules(logits, rows, torch.tensor(pending_tokens or [0]))
    assert sum(r is not None for r in rows) > 30
    want = torch.tensor(want)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.allclose(got[~torch.isinf(got)], want[~torch.isinf(want)], atol=1e-5)
    assert not torch.isnan(logits).any()


def test_sparse_and_dense_penalties_give_the_same_floats(monkeypatch):
    """The penalties over the histories' tokens only (CPU) and over every logit (CUDA) agree to the
    bit: rows with a repetition penalty of 1 (divided by 1 where the dense ops leave them), negative
    frequency and presence penalties, -0.0 and -inf logits, drafts and rows sharing a history."""
    g = torch.Generator().manual_seed(5)
    V = 64
    logits = torch.randn(24, V, generator=g) * 4
    logits[:, 7], logits[:, 9], logits[3, 11] = -0.0, 0.0, -INF
    hist = object()
    rows = []
    for i in range(24):
        p = SamplingParams(repetition_penalty=[1.0, 1.4, 0.7][i % 3], frequency_penalty=[0.0, -0.8, 1.3][i % 2],
                           presence_penalty=[0.5, -1.1, 0.0][i % 3])
        if p.repetition_penalty == 1.0 and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0:
            p = SamplingParams(presence_penalty=0.25)
        rule = LogitsRule.of(p, set(), V)
        prompt = torch.randint(0, V, (5,), generator=g).tolist() + [7, 11]
        output = torch.randint(0, V, (1 + i % 6,), generator=g).tolist() + [9]
        rows.append(RuleRow(rule, 1.0, prompt, output, output[:i % 3], history=hist if i < 4 else None))
    rows[0:4] = [dataclasses.replace(rows[0], extra=[5] * j) for j in range(4)]  # one history, its drafts
    got = {}
    for sparse in (True, False):
        monkeypatch.setattr(logits_rules, "_sparse_penalties", lambda device, sparse=sparse: sparse)
        got[sparse] = apply_logits_rules(logits, rows)
    assert torch.equal(got[True], got[False])
    assert torch.equal(torch.signbit(got[True]), torch.signbit(got[False]))
    assert not torch.equal(got[True], logits)


def test_chunks_of_penalized_rows_give_the_same_logits(monkeypatch):
    """Penalized rows are counted a chunk at a time (CHUNK_ELEMENTS): rows that share a history
    object must still each get their own drafts."""
    g = torch.Generator().manual_seed(1)
    V = 16
    logits = torch.randn(9, V, generator=g)
    rule = LogitsRule.of(SamplingParams(frequency_penalty=1.0, presence_penalty=0.5, repetition_penalty=1.3), set(), V)
    hist = object()
    rows = [RuleRow(rule, 1.0, [1, 2], [4, 4, 5], [6] * j, history=hist) for j in range(9)]
    whole = apply_logits_rules(logits, rows)
    monkeypatch.setattr(logits_rules, "CHUNK_ELEMENTS", 2 * V)
    assert torch.equal(apply_logits_rules(logits, rows), whole)
    assert whole[8, 6] < whole[0, 6] - 7  # eight drafts of token 6 counted in the last row


def test_chunks_of_penalized_rows_count_their_own_pending_tokens(monkeypatch):
    """Async scheduling's pending tokens (still on the device) land in their own row's counts
    whatever chunk the row falls in."""
    g = torch.Generator().manual_seed(2)
    V = 16
    logits = torch.randn(9, V, generator=g)
    rule = LogitsRule.of(SamplingParams(frequency_penalty=1.0, presence_penalty=0.5, repetition_penalty=1.3), set(), V)
    pending_tokens = torch.tensor([3, 9, 12, 7])
    rows = [RuleRow(rule, 1.0, [1], [4, j % V], [], pending=(j % 4 if j % 3 else -1)) for j in range(9)]
    whole = apply_logits_rules(logits, rows, pending_tokens)
    monkeypatch.setattr(logits_rules, "CHUNK_ELEMENTS", 2 * V)
    assert torch.equal(apply_logits_rules(logits, rows, pending_tokens), whole)
    for j in (4, 5, 7, 8):  # rows with a pending token in later chunks: it is penalized there
        tok = int(pending_tokens[j % 4])
        alone = apply_logits_rules(logits[j:j + 1], [dataclasses.replace(rows[j], output=rows[j].output + [tok],
                                                                          pending=-1)])
        assert torch.allclose(whole[j], alone[0])


def test_no_rule_leaves_the_logits_alone():
    logits = torch.randn(3, 8)
    assert apply_logits_rules(logits, [None, None, None]) is logits
    assert LogitsRule.of(SamplingParams(), {0}, 8) is None
    # greedy: min_p cannot change an argmax, so it is no rule; min_tokens without any stop token neither
    assert LogitsRule.of(SamplingParams(temperature=0, min_p=0.5), {0}, 8) is None
    assert LogitsRule.of(SamplingParams(min_tokens=3, ignore_eos=True), set(), 8) is None
    # vLLM masks the end of sequence under min_tokens even with ignore_eos
    assert LogitsRule.of(SamplingParams(min_tokens=3, ignore_eos=True), {0}, 8).min_tokens_ban == (0,)


@pytest.mark.parametrize("kw, param", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(min_p=1.5), "min_p"),
    (dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=9, max_tokens=8), "min_tokens"),
    (dict(logit_bias={"a": 1.0}), "logit_bias"), (dict(logit_bias={1: float("nan")}), "logit_bias"),
    (dict(logit_bias={"\u00b2": 1.0}), "logit_bias"),
    (dict(logit_bias=[1, 2]), "logit_bias"), (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[-1]), "allowed_token_ids"), (dict(presence_penalty="1"), "presence_penalty"),
])
def test_bad_values_name_their_field(kw, param):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kw)
    assert e.value.param == param


def test_token_ids_outside_the_vocabulary_fail_the_request_alone():
    llm = LLM("tiny")
    V = llm.llm_engine.model_config.vocab_size
    for kw, param in ((dict(logit_bias={V: 1.0}), "logit_bias"), (dict(allowed_token_ids=[1, V + 5]), "allowed_token_ids")):
        with pytest.raises(InvalidRequestError, match="outside the vocabulary") as e:
            llm.llm_engine.add_request("bad", [1, 2, 3], SamplingParams(**kw))
        assert e.value.param == param
        assert not llm.llm_engine.has_unfinished_requests()
    # string keys (JSON) are token ids
    assert SamplingParams(logit_bias={"7": 2}).logit_bias == {7: 2.0}


# ---- through the engine -------------------------------------------------------------------

PROMPTS = [[5, 17, 17, 40, 9], [100, 7, 7, 7, 3, 12, 88], [250, 251]]


def _ruled_params(seed: int | None = None, **kw):
    """Several rules at once (the tiny model's greedy output repeats a lot: the penalties bite)."""
    base = dict(max_tokens=24, ignore_eos=True, presence_penalty=0.8, frequency_penalty=0.4,
                repetition_penalty=1.3, logit_bias={202: -3.0, 11: 2.0}, min_tokens=5, stop_token_ids=[872])
    base.update(kw)
    return SamplingParams(seed=seed, **base)


def _greedy_reference(llm, prompt, params, bad=()):
    """Token by token with the raw logits of a full forward and the brute-force rule (bad: the
    bad words' token ids)."""
    from adaspec.models.loader import load_target

    model, _ = load_target("tiny")
    eos = llm.llm_engine.stop_checker.eos_token_ids
    out = []
    with torch.no_grad():
        while len(out) < params.max_tokens:
            logits = model.compute_logits(model.forward_dense(torch.tensor([prompt + out])))[0, -1].float()
            x = reference_row(logits.tolist(), params, prompt, out, eos, bad)
            tok = max(range(len(x)), key=lambda t: x[t])
            out.append(tok)
            if tok in params.stop_token_ids:
                break
    return out


def test_greedy_rules_match_the_reference_decode_in_every_arm():
    """Greedy decoding with rules: the plain engine (sync and async), fixed-k speculation and
    adaptive give the brute-force decode's tokens, and the rules really change them."""
    params = _ruled_params(temperature=0.0)
    plain = LLM("tiny", async_scheduling=False)
    want = [_greedy_reference(plain, p, params) for p in PROMPTS]
    unruled = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24,
                                                                                      ignore_eos=True))]
    assert all(w != u for w, u in zip(want, unruled))
    arms = {"sync": plain, "async": LLM("tiny", async_scheduling=True),
            "fixed": LLM("tiny", speculative_config={"method": "dspark", "num_speculative_tokens": 4}),
            "adaptive": LLM("tiny", speculative_config={"method": "dspark", "enable_adaptive_verification": True})}
    pin_cost_tables(arms["adaptive"])  # its drafts must run whatever this machine's load makes of the tables
    for name, llm in arms.items():
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        assert got == want, name
        if name in ("fixed", "adaptive"):
            assert llm.llm_engine.stats.num_accepted_tokens > 0, name


def test_async_rows_count_the_token_still_on_the_device(monkeypatch):
    """Async scheduling launches a step before the last token is read back: the penalties must
    count that token from the device (seeded sampling: the async engine's tokens are the sync one's)."""
    calls = []
    original = apply_logits_rules

    def spy(logits, rows, pending_tokens=None, grammars=True):
        calls.append(pending_tokens is not None and any(r is not None and r.pending >= 0 for r in rows))
        return original(logits, rows, pending_tokens, grammars)

    monkeypatch.setattr(logits_rules, "apply_logits_rules", spy)  # (what the engine's logits_with_rules calls)
    params = [_ruled_params(seed=s, temperature=1.0) for s in range(3)]
    want = [o.outputs[0].token_ids for o in LLM("tiny", async_scheduling=False).generate(PROMPTS, params)]
    calls.clear()
    got = [o.outputs[0].token_ids for o in LLM("tiny", async_scheduling=True).generate(PROMPTS, params)]
    assert any(calls)
    assert got == want


def test_min_tokens_holds_back_stop_tokens_and_stop_strings():
    llm = LLM("tiny")
    eos = sorted(llm.llm_engine.stop_checker.eos_token_ids)[0]
    # every token but the end of sequence is pushed down: without min_tokens it ends at once
    bias = {eos: 50.0}
    first = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=20, logit_bias=bias))[0].outputs[0]
    assert first.token_ids == [eos] and first.finish_reason == "stop"
    held = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=20, logit_bias=bias,
                                                     min_tokens=6))[0].outputs[0]
    assert len(held.token_ids) == 7 and held.token_ids[-1] == eos and eos not in held.token_ids[:6]
    # a stop string is looked for only after min_tokens, and only where it ends after the text of
    # the first min_tokens tokens (vLLM's detokenizer): one completed by token min_tokens does not stop
    greedy = dict(temperature=0, max_tokens=12, ignore_eos=True)
    out = llm.generate([PROMPTS[1]], SamplingParams(**greedy))[0].outputs[0]
    tok = llm.get_tokenizer()
    first = [tok.decode(out.token_ids[:n]) for n in range(1, 5)]
    assert len(set(first)) == 4 and len(first[1]) >= 2  # each of the first tokens writes some text
    inside = first[1][-2:]  # completed by token 2
    early = llm.generate([PROMPTS[1]], SamplingParams(**greedy, stop=[inside]))[0].outputs[0]
    assert early.finish_reason == "stop" and len(early.token_ids) <= 2
    held = llm.generate([PROMPTS[1]], SamplingParams(**greedy, stop=[inside], min_tokens=2))[0].outputs[0]
    assert inside not in out.text[len(first[1]) - 1:] or held.finish_reason == "stop"
    if inside not in out.text[len(first[1]) - 1:]:  # nowhere later: it never stops
        assert held.finish_reason == "length" and held.token_ids == out.token_ids
    later = first[3][len(first[2]) - 1:]  # ends inside token 4's text: it stops there
    held = llm.generate([PROMPTS[1]], SamplingParams(**greedy, stop=[later], min_tokens=2))[0].outputs[0]
    assert held.finish_reason == "stop" and len(held.token_ids) == 4


def test_allowed_token_ids_and_logit_bias_in_sampled_speculation():
    llm = LLM("tiny", speculative_config={"method": "dspark", "num_speculative_tokens": 4})
    allowed = [5, 9, 202, 262, 607]
    outs = llm.generate(PROMPTS, SamplingParams(temperature=1.0, seed=3, max_tokens=30, ignore_eos=True,
                                                allowed_token_ids=allowed))
    assert all(set(o.outputs[0].token_ids) <= set(allowed) for o in outs)
    banned = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                  logit_bias={202: -100, 262: -100}))
    assert all(not {202, 262} & set(o.outputs[0].token_ids) for o in banned)


@pytest.mark.parametrize("variant", ["fixed", "adaptive", "async"])
def test_graphed_speculative_step_runs_ruled_rows_in_its_graphs(variant):
    """A row with a rule decodes in the graphs (captured eagerly on CPU) beside plain rows, its
    verification redone after the replay with its drafts in its history (graphed_extras.py); no
    decoding row goes to the eager step, and each gets the tokens an engine without graphs gives it
    (greedy: the same target argmax under the same rule, whatever the drafts). Under async
    scheduling a step with a ruled row runs synchronously (its rule reads the tokens of the step
    before on the host), and the plain rows pipeline once the ruled ones end."""
    cfg = {"method": "dspark", "num_speculative_tokens": 4, "enable_adaptive_verification": variant == "adaptive"}
    ruled = _ruled_params(temperature=0.0, max_tokens=12)
    plain = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    params = [ruled, plain, ruled]
    want = [o.outputs[0].token_ids for o in LLM("tiny", speculative_config=cfg).generate(PROMPTS, params)]
    llm = LLM("tiny", speculative_config=cfg, async_scheduling=variant == "async")
    if variant == "adaptive":
        pin_cost_tables(llm)  # its drafts must run whatever this machine's load makes of the tables
    use_eager_spec_graphs(llm, [1, 4])
    no_eager_decodes(llm)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    st = llm.llm_engine.stats
    assert st.num_graphed_steps > 5 and st.num_accepted_tokens > 0
    assert (st.num_pipelined_steps > 0) == (variant == "async")
    assert got == want


def test_bad_words_in_every_arm():
    """vLLM's bad_words: a word's last token is masked where the output ends with the rest of it.
    The tiny model's greedy outputs write "self.assertEqual" (several tokens) and "wise" (repeated);
    banned, they disappear, and every arm gives the brute-force decode's tokens (the multi-token
    word is matched across a verification's drafts and, under async scheduling, against the last
    token still on the device)."""
    plain = LLM("tiny", async_scheduling=False)
    ids = bad_word_ids(["self.assertEqual", "wise"], plain.get_tokenizer())
    assert any(len(w) > 2 for w in ids)
    base = dict(temperature=0.0, max_tokens=24, ignore_eos=True)
    before = [o.outputs[0] for o in plain.generate(PROMPTS, SamplingParams(**base))]
    assert "self.assertEqual" in before[0].text and "wise" in before[2].text
    params = SamplingParams(**base, bad_words=["self.assertEqual", "wise"])
    want = [_greedy_reference(plain, p, params, ids) for p in PROMPTS]
    arms = {"sync": plain, "async": LLM("tiny", async_scheduling=True),
            "fixed": LLM("tiny", speculative_config={"method": "dspark", "num_speculative_tokens": 4})}
    for name, llm in arms.items():
        outs = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
        assert [o.token_ids for o in outs] == want, name
        assert not any("self.assertEqual" in o.text or "wise" in o.text for o in outs), name
    with pytest.raises(InvalidRequestError, match="bad_words need a tokenizer") as e:
        LLM("tiny", skip_tokenizer_init=True).llm_engine.add_request("b", [1, 2], params)
    assert e.value.param == "bad_words"
    with pytest.raises(InvalidRequestError, match="bad_words must be"):
        SamplingParams(bad_words=["ok", " "])


def test_the_drafter_follows_the_additive_part_of_a_rule():
    """logits_rules.draft_bias: the drafter proposes within allowed_token_ids and never a banned
    token, so its drafts can be accepted (without it every draft outside the set was rejected);
    the target's tokens are the same either way (greedy)."""
    allowed = [5, 9, 202, 262, 607]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, allowed_token_ids=allowed,
                            logit_bias={9: -100})
    cfg = {"method": "dspark", "num_speculative_tokens": 4}
    runs = {}
    for follow in (True, False):
        llm = LLM("tiny", speculative_config=cfg)
        spec, drafted = llm.llm_engine.spec, []
        if not follow:
            spec.drafter.propose = lambda *a, inner=spec.drafter.propose, **kw: inner(*a, **{**kw, "draft_bias": None})

        def record(*a, inner=spec.drafter.draft_block, **kw):
            prop = inner(*a, **kw)
            drafted.extend(prop.tokens.flatten().tolist())
            return prop

        spec.drafter.draft_block = record
        outs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        runs[follow] = (outs, drafted, llm.llm_engine.stats.num_accepted_tokens)
    assert runs[True][0] == runs[False][0]
    assert all(set(o) <= set(allowed) - {9} for o in runs[True][0])
    assert runs[True][1] and set(runs[True][1]) <= set(allowed) - {9}
    assert not set(runs[False][1]) <= set(allowed)
    assert runs[True][2] > runs[False][2]


def test_rules_that_leave_no_token_or_overflow_are_caught():
    """A row with every token masked would sample from a NaN softmax (a silent token 0): refused
    where the rule alone says so; a logit overflowing float32 is kept the largest finite one."""
    llm = LLM("tiny")
    eos = sorted(llm.llm_engine.stop_checker.eos_token_ids)[0]
    for kw in (dict(allowed_token_ids=[eos], min_tokens=3), dict(allowed_token_ids=[7], stop_token_ids=[7], min_tokens=2),
               dict(allowed_token_ids=[7, 8], bad_words=[llm.get_tokenizer().decode([7]), llm.get_tokenizer().decode([8])])):
        with pytest.raises(InvalidRequestError, match="allowed_token_ids leaves no token") as e:
            llm.llm_engine.add_request("none-left", [1, 2], SamplingParams(**kw))
        assert e.value.param == "allowed_token_ids" and not llm.llm_engine.has_unfinished_requests()
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=1.0, seed=0, max_tokens=3, ignore_eos=True,
                                                    logit_bias={11: 1e39}))[0].outputs[0]
    assert out.token_ids == [11, 11, 11]
    tiny_penalty = SamplingParams(temperature=1.0, seed=0, max_tokens=8, ignore_eos=True, repetition_penalty=1e-40)
    assert 0 not in llm.generate([PROMPTS[0]], tiny_penalty)[0].outputs[0].token_ids


def test_requests_with_the_same_allowed_ids_and_bias_share_one_upload(monkeypatch):
    """Requests sent with the same allowed_token_ids / logit_bias make their mask and bias tensors
    once; other contents get their own, and the shared entries are bounded (least recently used
    dropped), while a rule keeps what it got."""
    monkeypatch.setattr(logits_rules, "_shared_tensors", logits_rules.SharedTensors(capacity=2))
    uploads = []
    real = logits_rules.to_device
    monkeypatch.setattr(logits_rules, "to_device", lambda x, *a, **k: uploads.append(len(x)) or real(x, *a, **k))
    V = 50

    def rule(allowed, bias=None):
        return LogitsRule.of(SamplingParams(allowed_token_ids=allowed, logit_bias=bias), {0}, V)

    a, b = rule([3, 1, 2], {4: 1.5}), rule([1, 2, 3], {4: 1.5})  # same contents, other order
    mask_a, bias_a = a.allowed_mask(V, "cpu"), a.bias_tensors("cpu")
    assert len(uploads) == 3  # the mask's ids, the bias's ids and values
    assert b.allowed_mask(V, "cpu") is mask_a and b.bias_tensors("cpu") is bias_a
    assert len(uploads) == 3
    assert mask_a.nonzero().flatten().tolist() == [1, 2, 3] and bias_a[1].tolist() == [1.5]
    mask_c = rule([5, 6]).allowed_mask(V, "cpu")  # entries: a's bias, c's mask (a's mask dropped)
    assert mask_c is not mask_a and mask_c.nonzero().flatten().tolist() == [5, 6]
    assert len(logits_rules._shared_tensors) == 2
    assert a.allowed_mask(V, "cpu") is mask_a  # a keeps its own
    again = rule([1, 2, 3]).allowed_mask(V, "cpu")
    assert again is not mask_a and again.equal(mask_a)  # made again: it was no longer shared
    assert rule([5, 6]).allowed_mask(V, "cpu") is mask_c  # c's used last now, then a's second mask
    rule([7]).allowed_mask(V, "cpu")  # drops the least recently used: `again`, not c's
    assert rule([5, 6]).allowed_mask(V, "cpu") is mask_c
    assert rule([1, 2, 3]).allowed_mask(V, "cpu") is not again
