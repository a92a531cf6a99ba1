"""Structured outputs (sample/structured_outputs.py): the masks of verification positions against
a fresh matcher fed the same history, the engine's outputs against their constraint (plain, fixed k,
adaptive, async scheduling, n > 1), bad constraints refused request by request, and losslessness:
the speculative engine's law of the first tokens under a grammar against the target's exact
constrained law, with a harness shown to catch masks computed from the wrong history."""
import gc
import json
import re
import weakref

import llguidance
import pytest
import torch

from adaspec import LLM, SamplingParams
from adaspec.config import EngineConfig
from adaspec.errors import ConfigError, InvalidRequestError
from adaspec.models.loader import load_target
from adaspec.models.tokenizer import Tokenizer
from adaspec.sample import structured_outputs
from adaspec.sample.logits_rules import LogitsRule, RuleRow, apply_logits_rules
from adaspec.sample.probs import processed_probs
from adaspec.sampling_params import StructuredOutputsParams as SO
from adaspec.testing import no_eager_decodes, run_waves_keeping_sequences, use_eager_spec_graphs
from tests.spec_decode.lossless_harness import enumerate_joint, lossless_pvalue

# a test dependency (pyproject's test extra); a GPU machine without it runs `pytest -m gpu` past
# this module (it has no GPU test) instead of stopping at its collection (H100 run 46)
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
REGEX = r"[0-9]{3}-[a-z]{2,5}"
CHOICES = ["yes", "no", "maybe"]
LARK = 'start: "A" ("b" | "c")* "D"'
# (json with disable_any_whitespace: the tiny model's JSON otherwise wanders in whitespace)
CONSTRAINTS = {"json": SO(json=SCHEMA, disable_any_whitespace=True), "regex": SO(regex=REGEX),
               "choice": SO(choice=CHOICES), "grammar": SO(grammar=LARK),
               "json_object": SO(json_object=True, disable_any_whitespace=True)}
PROMPTS = ["Once upon a time", "The answer is", "def main():"]
ARMS = {"none": None, "fixed": {"method": "dspark", "num_speculative_tokens": 4},
        "adaptive": {"method": "dspark", "enable_adaptive_verification": True}}


def follows(kind: str, text: str) -> bool:
    if kind == "json":
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if kind == "json_object":
        try:
            return isinstance(json.loads(text), dict)
        except ValueError:
            return False
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    return re.fullmatch(r"A[bc]*D", text) is not None


# ---- the masks -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_tokenizer():
    from adaspec.models.registry import resolve_model_path

    return Tokenizer.from_dir(resolve_model_path("tiny"))


class History:
    """What an engine Sequence keeps for a grammar (its state between calls)."""

    request_id = "r"
    grammar_state = None


def reference_mask(grammar, history: list[int], V: int) -> list[bool] | None:
    """A fresh matcher fed the whole history: the tokens it allows next (None: the history breaks
    the grammar, a position that is never reached)."""
    m = grammar.matcher()
    for t in history:
        if not m.consume_token(t):
            return None
    bits = m.compute_bitmask()
    return [bool(bits[t // 8] >> (t % 8) & 1) for t in range(V)]


def test_verification_positions_get_the_mask_of_their_own_history(tiny_tokenizer):
    V = tiny_tokenizer.vocab_size
    eos = {tiny_tokenizer.eos_token_id}
    rule = LogitsRule.of(SamplingParams(structured_outputs=CONSTRAINTS["json"]), eos, V, tiny_tokenizer)
    valid = tiny_tokenizer.encode('{"name":"Bob","age":42}')
    g = torch.Generator().manual_seed(0)
    for trial in range(12):
        cut = int(torch.randint(0, len(valid) - 5, (), generator=g))
        output, drafts = valid[:cut], list(valid[cut:cut + 4])
        if trial % 3 == 1:  # a draft the grammar refuses: the positions after it are never reached
            drafts[1] = int(torch.randint(0, V, (), generator=g))
        hist = History()
        rows = [RuleRow(rule, 1.0, [], output, drafts[:j], history=hist) for j in range(len(drafts) + 1)]
        if trial % 2:  # rows of several requests interleaved, and out of order
            other = History()
            rows = rows[::-1] + [RuleRow(rule, 1.0, [], valid[:3], [], history=other)]
        logits = torch.zeros(len(rows), V)
        got = apply_logits_rules(logits, rows)
        for r, row in enumerate(rows):
            want = reference_mask(rule.grammar, row.output + row.extra, V)
            if want is None:
                continue
            assert (got[r] > -float("inf")).tolist() == want, (trial, r)
        assert hist.grammar_state.num_consumed == len(output)  # the drafts were rolled back


def test_positions_that_are_not_one_block_are_masked_one_by_one(tiny_tokenizer):
    V = tiny_tokenizer.vocab_size
    rule = LogitsRule.of(SamplingParams(structured_outputs=CONSTRAINTS["json"]), {0}, V, tiny_tokenizer)
    valid = tiny_tokenizer.encode('{"name":"Al","age":7}')
    hist = History()
    rows = [RuleRow(rule, 1.0, [], valid[:2], valid[2:5], history=hist),
            RuleRow(rule, 1.0, [], valid[:2], valid[2:3], history=hist)]  # lengths 3 and 1: no block
    got = apply_logits_rules(torch.zeros(2, V), rows)
    for r, row in enumerate(rows):
        assert (got[r] > -float("inf")).tolist() == reference_mask(rule.grammar, row.output + row.extra, V)


def test_a_complete_output_allows_the_end_of_sequence_only_and_beats_min_tokens(tiny_tokenizer):
    V, eos = tiny_tokenizer.vocab_size, tiny_tokenizer.eos_token_id
    params = SamplingParams(structured_outputs=SO(choice=["yes"]), min_tokens=10)
    rule = LogitsRule.of(params, {eos}, V, tiny_tokenizer)
    done = tiny_tokenizer.encode("yes")
    got = apply_logits_rules(torch.randn(1, V), [RuleRow(rule, 1.0, [], done, [], history=History())])
    # min_tokens holds the end of sequence back, the grammar allows nothing else: the grammar wins
    assert (got[0] > -float("inf")).nonzero().flatten().tolist() == [eos]


def test_the_drafters_first_slot_follows_the_grammar_and_the_others_do_not(tiny_tokenizer):
    """logits_rules.draft_bias: the first draft slot gets the grammar's mask at the anchor; the
    slots after it follow drafts the host does not know yet, so they get the other rules only."""
    from adaspec.sample.logits_rules import draft_bias

    V = tiny_tokenizer.vocab_size
    rule = LogitsRule.of(SamplingParams(structured_outputs=SO(regex="a+b"), logit_bias={5: 2.0}), {0}, V,
                         tiny_tokenizer)

    class Seq:
        logits_rule, prompt_token_ids, params, request_id = rule, [1], SamplingParams(), "s"
        token_ids = [1] + tiny_tokenizer.encode("aa")
        grammar_state = logits_rule_state = None

    bias = draft_bias([Seq()], V, "cpu")
    assert bias.shape == (1, 2, V)
    want = reference_mask(rule.grammar, tiny_tokenizer.encode("aa"), V)
    assert (bias[0, 0] > -float("inf")).tolist() == want and 0 < sum(want) < V
    others = torch.zeros(V)
    others[5] = 2.0
    assert torch.equal(bias[0, 1], others)


def waiting_reference_mask(grammar, history: list[int], marker: int, V: int) -> list[bool] | None:
    """A grammar that starts after ``marker``: every token allowed until it has come, then the
    grammar's mask of what followed it."""
    if marker not in history:
        return [True] * V
    return reference_mask(grammar, history[history.index(marker) + 1:], V)


def test_a_grammar_that_waits_for_a_token_masks_only_after_it(tiny_tokenizer):
    """--reasoning-parser: the grammar holds after the end of the thinking, found in the output or
    among a block's drafts; every position's mask is the reference's for its own history, in one
    block or position by position, and the verification reach counts from where it starts."""
    from adaspec.sample.structured_outputs import grammar_reach

    V = tiny_tokenizer.vocab_size
    eos = {tiny_tokenizer.eos_token_id}
    marker = tiny_tokenizer.encode("Q")[0]
    rule = LogitsRule.of(SamplingParams(structured_outputs=SO(regex="[0-9]+")), eos, V, tiny_tokenizer,
                         grammar_after=marker)
    one, two, x = (tiny_tokenizer.encode(c)[0] for c in "12x")
    cases = [([x, x], [x, marker, one, two]),  # the thinking ends among the drafts
             ([x], [x, x, x]),  # not yet
             ([x, marker], [one, two, x]),  # ended in the output; a refused draft
             ([x], [marker])]
    for output, drafts in cases:
        for block in (True, False):
            hist = History()
            rows = [RuleRow(rule, 1.0, [], output, drafts[:j], history=hist) for j in range(len(drafts) + 1)]
            if not block:
                rows = rows[::2]  # not one block: masked one position at a time
            got = apply_logits_rules(torch.zeros(len(rows), V), rows)
            for r, row in enumerate(rows):
                want = waiting_reference_mask(rule.grammar, row.output + row.extra, marker, V)
                if want is not None:
                    assert (got[r] > -float("inf")).tolist() == want, (output, drafts, block, r)

    class Seq:
        logits_rule, prompt_token_ids, request_id, grammar_state = rule, [1], "s", None
        token_ids = [1, x]

    assert grammar_reach([Seq(), Seq(), Seq()], [[x, marker, one, x, one], [x, x, x], [marker, x, one]]) == [4, 3, 2]


def test_verification_reaches_the_first_refused_draft_and_no_further(tiny_tokenizer):
    """structured_outputs.grammar_reach: the first draft the grammar refuses is still verified (its
    rejection samples the residual law; skipping it would sample the target's own law there, which
    is not the same: 0.62 / 0.38 instead of 0.7 / 0.3 for p = (0.7, 0.3, 0), q = (0.2, 0.2, 0.6)),
    and nothing after it."""
    from adaspec.sample.structured_outputs import grammar_reach

    V = tiny_tokenizer.vocab_size
    rule = LogitsRule.of(SamplingParams(structured_outputs=SO(regex="[0-9]+")), {0}, V, tiny_tokenizer)
    one, two, letter = (tiny_tokenizer.encode(c)[0] for c in "12a")

    class Seq:
        logits_rule, prompt_token_ids, request_id, grammar_state = rule, [1], "s", None
        token_ids = [1, one]

    seqs = [Seq(), Seq(), Seq(), Seq()]
    blocks = [[one, two, letter, one], [one, two, one, two], [letter, one, one, one], [one, letter]]
    assert grammar_reach(seqs, blocks) == [3, 4, 1, 2]
    free = type("Free", (), {"logits_rule": None})()
    assert grammar_reach([free], [[letter, letter]]) == [2]


def test_calibration_counts_the_slots_past_a_refused_draft_as_rejected(monkeypatch):
    """The cap at the first refused draft (grammar_reach) verifies fewer positions, but the
    per-position statistics and the policy's realized / predicted counts see the policy's planned
    lengths (those slots were certain rejections): the same as without the cap, while
    num_verified_tokens counts what was verified and num_grammar_skipped_slots the rest."""
    import adaspec.spec_decode.step as step_module

    cfg = {"method": "dspark", "num_speculative_tokens": 4}
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=SO(regex="[a-z ,.]{400}"))

    def run():
        llm = LLM("tiny", speculative_config=cfg)
        outs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        return outs, llm.llm_engine.stats

    capped_out, capped = run()
    monkeypatch.setattr(step_module, "grammar_reach", lambda seqs, drafts: [len(d) for d in drafts])
    full_out, full = run()
    assert capped_out == full_out and capped.num_accepted_tokens == full.num_accepted_tokens
    assert capped.num_grammar_skipped_slots > 0 and full.num_grammar_skipped_slots == 0
    assert capped.num_verified_tokens + capped.num_grammar_skipped_slots == full.num_verified_tokens
    assert capped.verified_per_pos == full.verified_per_pos
    assert capped.predicted_accept_per_pos == pytest.approx(full.predicted_accept_per_pos)


def test_penalties_that_overflow_leave_the_grammar_its_tokens():
    """A repetition penalty of 1e39 overflows float32 to -inf on the only token the grammar allows
    (made negative by a bias): the grammar wins, as for min_tokens, instead of a row of -inf
    sampling garbage."""
    llm = LLM("tiny")
    x = llm.get_tokenizer().encode("x")[0]
    for temperature in (0.0, 1.0):
        out = llm.generate(["x x x"], SamplingParams(temperature=temperature, seed=0, max_tokens=4,
                                                     repetition_penalty=1e39, logit_bias={x: -20.0},
                                                     structured_outputs=SO(regex="x")), use_tqdm=False)
        assert out[0].outputs[0].text == "x", temperature


@pytest.mark.parametrize("params, says", [
    (SO(regex="(((("), "unclosed group"),
    (SO(grammar="start: foo"), "unknown name"),
    (SO(json='{"type": "object"'), "not valid JSON"),
    (SO(json={"type": "object", "properties": {"a": {"$ref": "#/nope"}}}), "does not compile"),
])
def test_a_constraint_that_does_not_compile_is_refused_with_llguidances_reason(tiny_tokenizer, params, says):
    with pytest.raises(InvalidRequestError, match=re.escape(says)) as e:
        LogitsRule.of(SamplingParams(structured_outputs=params), {0}, tiny_tokenizer.vocab_size, tiny_tokenizer)
    assert e.value.param == "structured_outputs"


def test_requests_with_the_same_constraint_compile_it_once(tiny_tokenizer, monkeypatch):
    """Compiled grammars are kept per tokenizer (the same tools or response_format on every
    request): a second request's grammar is the first's, without a compile; the least recently used
    go past MAX_COMPILED_PER_TOKENIZER, and a constraint that fails is not kept."""
    compiles = []
    real = llguidance.LLMatcher
    monkeypatch.setattr(llguidance, "LLMatcher", lambda *a, **k: compiles.append(a[1]) or real(*a, **k))
    monkeypatch.setattr(structured_outputs, "_pools", weakref.WeakKeyDictionary())  # no other test's
    monkeypatch.setattr(structured_outputs, "MAX_COMPILED_PER_TOKENIZER", 2)

    def rule(regex):
        return LogitsRule.of(SamplingParams(structured_outputs=SO(regex=regex)), {0}, tiny_tokenizer.vocab_size,
                             tiny_tokenizer)

    a, b = rule("a{2}b{7}"), rule("a{2}b{7}")
    assert len(compiles) == 1 and a.grammar.pool is b.grammar.pool
    rule("x{3}"), rule("a{2}b{7}"), rule("y{3}")  # x{3} is now the least recently used of three
    assert len(compiles) == 3
    rule("a{2}b{7}")
    assert len(compiles) == 3
    rule("x{3}")
    assert len(compiles) == 4
    for _ in range(2):
        with pytest.raises(InvalidRequestError):
            rule("((((")
    assert len(compiles) == 6


def test_live_requests_hold_matchers_of_their_own_compile_and_finished_ones_give_them_back(tiny_tokenizer,
                                                                                            monkeypatch):
    """Every live request's matcher is a compile of its own (llguidance's copies of one matcher
    share its lexer behind a lock: their masks would be computed one at a time), none is lent
    twice, and a finished request's matcher goes back to the pool reset, for the next request; one
    that broke is dropped, and the pool keeps at most MAX_FREE_MATCHERS."""
    compiles = []
    real = llguidance.LLMatcher
    monkeypatch.setattr(llguidance, "LLMatcher", lambda *a, **k: compiles.append(a[1]) or real(*a, **k))
    monkeypatch.setattr(structured_outputs, "_pools", weakref.WeakKeyDictionary())  # no other test's
    monkeypatch.setattr(structured_outputs, "MAX_FREE_MATCHERS", 2)
    V = tiny_tokenizer.vocab_size
    grammar = LogitsRule.of(SamplingParams(structured_outputs=SO(regex="a{2}b{7}")), {0}, V, tiny_tokenizer).grammar
    fresh = grammar.matcher().compute_bitmask()  # the validating compile's matcher, not given back
    assert len(compiles) == 1
    states = [structured_outputs.GrammarState(grammar) for _ in range(3)]
    assert len(compiles) == 4 and len({id(s.matcher) for s in states}) == 3
    a = tiny_tokenizer.encode("a", add_special_tokens=False)[0]
    assert states[0].matcher.consume_token(a) and states[1].matcher.compute_bitmask() == fresh
    assert states[0].matcher.compute_bitmask() != fresh
    lent = [s.matcher for s in states]
    del states[0]  # the advanced one finishes first (then it is among the two kept)
    gc.collect()
    states.clear()
    gc.collect()
    assert grammar.pool.num_free == 2  # three finished, two kept
    again = [structured_outputs.GrammarState(grammar) for _ in range(3)]
    assert len(compiles) == 5  # two from the pool, one compiled
    assert sum(any(s.matcher is m for m in lent) for s in again) == 2
    assert all(s.matcher.compute_bitmask() == fresh for s in again)  # reset: the advanced one too
    assert not again[0].matcher.consume_token(tiny_tokenizer.encode("c", add_special_tokens=False)[0])
    del again[0]  # the broken one finishes first
    gc.collect()
    assert grammar.pool.num_free == 0
    again.clear()
    gc.collect()
    assert grammar.pool.num_free == 2  # the broken one not among them
    assert all(grammar.matcher().compute_bitmask() == fresh for _ in range(2))


def test_params_take_exactly_one_constraint_and_vllms_dict_form():
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs == SO(regex="a+")
    for bad, says in (({"regex": "a", "choice": ["a"]}, "exactly one"), ({}, "exactly one"),
                      ({"choice": []}, "non-empty list"), ({"json": 5}, "JSON schema"),
                      ({"whitespace_pattern": " ", "regex": "a"}, "whitespace_pattern"),
                      ({"structural_tag": "{}"}, "structural_tag is not supported"), ({"bogus": 1}, "unknown")):
        with pytest.raises(InvalidRequestError, match=says):
            SamplingParams(structured_outputs=bad)
    with pytest.raises(InvalidRequestError, match="ignore_eos"):
        SamplingParams(structured_outputs=SO(regex="a"), ignore_eos=True)


# ---- through the engine ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engines():
    return {name: LLM("tiny", speculative_config=cfg) for name, cfg in ARMS.items()}


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_every_arm_follows_the_constraint_and_greedy_arms_agree(engines, kind):
    greedy = {}
    for name, llm in engines.items():
        for temperature in (0.0, 1.0):
            params = SamplingParams(temperature=temperature, max_tokens=80, seed=5, structured_outputs=CONSTRAINTS[kind])
            outs = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
            for o in outs:
                assert o.finish_reason == "stop" or kind in ("grammar", "json_object"), (name, o)
                if o.finish_reason == "stop":
                    assert follows(kind, o.text), (name, temperature, o.text)
                else:  # cut by max_tokens: a prefix of an output the constraint allows
                    assert grammar_of(llm, kind).matcher().consume_tokens(list(o.token_ids)), (name, o.text)
            if temperature == 0.0:
                greedy[name] = [o.token_ids for o in outs]
    assert greedy["fixed"] == greedy["none"] and greedy["adaptive"] == greedy["none"]


def grammar_of(llm, kind: str):
    eng = llm.llm_engine
    return structured_outputs.Grammar.of(CONSTRAINTS[kind], eng.tokenizer, eng.model_config.vocab_size,
                                         eng.stop_checker.eos_token_ids)


@pytest.mark.parametrize("arm", ["none", "fixed", "graphed"])
def test_logprobs_are_taken_after_the_grammars_mask(engines, arm):
    """As vLLM's (its bitmask goes on the logits before the sampler): a choice's top logprobs are
    tokens it allows, the greedy token is the top one, and the end of a complete output, the only
    token allowed there, has logprob 0; also where the speculative step's graphs (captured eagerly)
    serve the rows and their logprobs come from the redo after the replay."""
    if arm == "graphed":
        llm = LLM("tiny", speculative_config=ARMS["fixed"])
        use_eager_spec_graphs(llm, [1, 2, 4])
        no_eager_decodes(llm)
    else:
        llm = engines[arm]
    eos = llm.llm_engine.tokenizer.eos_token_id
    params = SamplingParams(temperature=0, max_tokens=20, logprobs=3, structured_outputs=SO(choice=CHOICES))
    for out in llm.generate(PROMPTS, params, use_tqdm=False):
        o = out.outputs[0]
        assert o.text in CHOICES and o.token_ids[-1] == eos
        matcher = grammar_of(llm, "choice").matcher()
        for token, top in zip(o.token_ids, o.logprobs):
            shown = [t for t, lp in top.items() if float(lp) > -float("inf")]
            bits = matcher.compute_bitmask()
            assert all(bits[t // 8] >> (t % 8) & 1 for t in shown), (token, top)
            assert float(top[token]) == max(float(lp) for lp in top.values())
            assert matcher.consume_token(token)
        assert float(o.logprobs[-1][eos]) == 0.0


def test_pipelined_steps_read_a_grammars_token_back(engines):
    """The speculative step's graphs (captured eagerly on the CPU) under async scheduling:
    constrained rows run in the graphs, in steps that are not pipelined, a pipelined step that
    sampled a constrained request's first token is drained before the next, and every greedy
    output is the synchronous engine's."""
    prompts = [PROMPTS[i % 3] * (1 + i % 4) for i in range(12)]
    kinds = [None, "regex", None, "choice", None, "json"]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True) if kinds[i % 6] is None else
              SamplingParams(temperature=0, max_tokens=24, structured_outputs=CONSTRAINTS[kinds[i % 6]])
              for i in range(len(prompts))]
    cfg = {"method": "dspark", "num_speculative_tokens": 4}
    want = [o.outputs[0].token_ids for o in LLM("tiny", speculative_config=cfg).generate(prompts, params,
                                                                                        use_tqdm=False)]
    llm = LLM("tiny", speculative_config=cfg, async_scheduling=True, max_num_seqs=6, max_num_batched_tokens=64)
    eng = llm.llm_engine
    use_eager_spec_graphs(llm, [1, 2, 4, 6])
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert eng.stats.num_pipeline_drains > 0 and eng.stats.num_graphed_steps > 0


def test_async_scheduling_reads_a_grammars_token_back_and_keeps_the_others_output(engines):
    so = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=CONSTRAINTS["regex"])
    free = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    params = [so, free, so, free]
    want = [o.outputs[0].token_ids for o in engines["none"].generate(PROMPTS + PROMPTS[:1], params, use_tqdm=False)]
    for cfg in (None, ARMS["adaptive"]):
        llm = LLM("tiny", speculative_config=cfg, async_scheduling=True)
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS + PROMPTS[:1], params, use_tqdm=False)]
        assert got == want, cfg


def test_parallel_samples_each_follow_the_grammar(engines):
    out = engines["fixed"].generate(PROMPTS[:1], SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=20,
                                                                 structured_outputs=SO(choice=CHOICES)),
                                    use_tqdm=False)[0]
    assert len(out.outputs) == 4 and all(o.text in CHOICES for o in out.outputs)


def test_a_bad_grammar_fails_its_request_alone(engines):
    eng = engines["fixed"].llm_engine
    with pytest.raises(InvalidRequestError, match="unclosed group"):
        eng.add_request("bad", PROMPTS[0], SamplingParams(structured_outputs=SO(regex="((")))
    assert not eng.has_unfinished_requests()
    out = engines["fixed"].generate(PROMPTS[:1], SamplingParams(temperature=0, structured_outputs=SO(choice=CHOICES)),
                                    use_tqdm=False)
    assert out[0].outputs[0].text in CHOICES


def test_a_grammar_the_models_vocabulary_cannot_continue_ends_the_output(lossless_micro_pair):
    """The micro target has 8 logits (the end of sequence, 3 special tokens, ! " # $) and a larger
    tokenizer: after "!", "z" exists only beyond its logits, so the mask allows the end of
    sequence instead of nothing (a row of -inf would sample garbage)."""
    tok = Tokenizer.from_dir(lossless_micro_pair[0])
    eos = tok.eos_token_id
    rule = LogitsRule.of(SamplingParams(structured_outputs=SO(regex="!z+")), {eos}, 8, tok)
    bang = tok.encode("!")
    got = apply_logits_rules(torch.zeros(2, 8), [RuleRow(rule, 1.0, [], [], [], history=History()),
                                                  RuleRow(rule, 1.0, [], bang, [], history=History())])
    assert (got[0] > -float("inf")).nonzero().flatten().tolist() == bang
    assert (got[1] > -float("inf")).nonzero().flatten().tolist() == [eos]
    llm = LLM(lossless_micro_pair[0])
    o = llm.generate([[1, 2, 3]], SamplingParams(temperature=1.0, max_tokens=5, structured_outputs=SO(regex="!z+")),
                     use_tqdm=False)[0].outputs[0]
    assert o.token_ids == bang + [eos] and o.finish_reason == "stop"


def test_without_a_tokenizer_structured_outputs_are_refused():
    llm = LLM("tiny", skip_tokenizer_init=True)
    with pytest.raises(InvalidRequestError, match="need a tokenizer"):
        llm.llm_engine.add_request("x", [5, 6, 7], SamplingParams(structured_outputs=SO(regex="a"), detokenize=False))


# ---- losslessness ---------------------------------------------------------------------------------
N = 20_000
PROMPT = [1, 2, 3]
L = 3
# ids 4-7 of the micro tokenizer are the characters ! " # $; the first two tokens are !" or "!
# or # and any of them, then # or $: which tokens a position allows depends on the tokens before
# it, so a mask taken from the wrong history (e.g. the block's anchor) changes the law
MICRO_REGEX = r'(!"|"!|#[!-$])[#$]+'
MICRO = SamplingParams(temperature=1.0, max_tokens=5, structured_outputs=SO(regex=MICRO_REGEX))


def exact_constrained_law(target_dir, prompt=PROMPT, mark: int | None = None, min_tokens: int = 0):
    """The exact law of the first L tokens under MICRO_REGEX: with ``mark``, the grammar holds only
    after that token (a thinking's end); with ``min_tokens``, no end of sequence before then."""
    model, _ = load_target(target_dir)
    tok = Tokenizer.from_dir(target_dir)
    lt = llguidance.LLTokenizer(tok.backend_json(), n_vocab=tok.vocab_size, eos_token=[tok.eos_token_id])
    grammar = llguidance.grammar_from("regex", MICRO_REGEX)

    def next_probs(ctx):
        out = list(ctx[len(prompt):])
        with torch.no_grad():
            logits = model.compute_logits(model.forward_dense(torch.tensor([list(ctx)])))[:, -1]
        allowed = torch.ones(logits.shape[-1], dtype=torch.bool)
        if len(out) < min_tokens:
            allowed[sorted(tok.eos_token_ids)] = False
        if mark is None or mark in out:
            m = llguidance.LLMatcher(lt, grammar)
            assert m.consume_tokens(out if mark is None else out[out.index(mark) + 1:])
            bits = m.compute_bitmask()
            allowed &= torch.tensor([bool(bits[t // 8] >> (t % 8) & 1) for t in range(logits.shape[-1])])
        return processed_probs(logits.masked_fill(~allowed, -float("inf")), torch.tensor([1.0]), torch.tensor([1.0]),
                               torch.tensor([0]))[0].tolist()

    return enumerate_joint(next_probs, L, prefix=tuple(prompt))


def grammar_samples(pair, tmp_path, graphed: bool = False):
    """graphed: decode steps through the speculative step's graphed path, captured eagerly (CPU),
    whose constrained rows are judged after the replay (spec_decode/graphed_extras.py)."""
    cfg = {"method": "dspark", "model": pair[1], "num_speculative_tokens": 3, "cost_model_cache_dir": str(tmp_path)}
    llm = LLM(pair[0], speculative_config=cfg, max_num_seqs=2048, max_num_batched_tokens=16384)
    if graphed:
        use_eager_spec_graphs(llm, [1, 16, 256, 2048])

    def run(n):
        torch.manual_seed(1234)
        outs = llm.generate([PROMPT] * n, MICRO, use_tqdm=False)
        st = llm.llm_engine.stats
        assert st.num_verified_tokens > n // 4 and st.num_accepted_tokens > 0  # speculation really ran
        assert (st.num_graphed_steps > 0) == graphed
        return [o.outputs[0].token_ids[:L] for o in outs]

    return run


@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graphed"])
def test_speculative_engine_under_a_grammar_is_lossless(lossless_micro_pair, tmp_path, graphed):
    p = lossless_pvalue(grammar_samples(lossless_micro_pair, tmp_path, graphed),
                        exact_constrained_law(lossless_micro_pair[0]), n=N)
    assert p > 1e-3


# a grammar that waits for the end of a thinking (EngineConfig.reasoning_parser): here "!" (id 4)
# ends it and '"' (id 5) opens it, so the first tokens are free until a "!", the grammar's after it;
# min_tokens keeps the end of sequence out of the first L tokens (free positions allow it)
MARK = 4
WAITING_PROMPT = [5, 2]  # opens the thinking ('"') and does not close it: the grammar waits
WAITING = SamplingParams(temperature=1.0, max_tokens=5, min_tokens=L, structured_outputs=SO(regex=MICRO_REGEX))


def test_speculative_engine_under_a_grammar_that_waits_for_the_thinking_is_lossless(lossless_micro_pair, tmp_path,
                                                                                     monkeypatch):
    """The end of the thinking comes among a block's drafts as often as not: its positions before
    it are free, after it masked from where it came; the law is still the target's."""
    from adaspec import reasoning_tags

    monkeypatch.setitem(reasoning_tags.REASONING_TAGS, "qwen3", ('"', "!"))
    cfg = {"method": "dspark", "model": lossless_micro_pair[1], "num_speculative_tokens": 3,
           "cost_model_cache_dir": str(tmp_path)}
    llm = LLM(lossless_micro_pair[0], speculative_config=cfg, max_num_seqs=2048, max_num_batched_tokens=16384,
              reasoning_parser="qwen3")
    assert llm.llm_engine.grammar_waits_for_thinking

    def run(n):
        torch.manual_seed(4321)
        outs = llm.generate([WAITING_PROMPT] * n, WAITING, use_tqdm=False)
        assert llm.llm_engine.stats.num_accepted_tokens > 0
        assert sum(MARK in o.outputs[0].token_ids[:L - 1] for o in outs) > n // 10  # the grammar did start
        return [o.outputs[0].token_ids[:L] for o in outs]

    p = lossless_pvalue(run, exact_constrained_law(lossless_micro_pair[0], WAITING_PROMPT, MARK, L), n=N)
    assert p > 1e-3


def test_a_prompt_that_closed_the_thinking_holds_the_reply_from_its_start(lossless_micro_pair, monkeypatch):
    """Qwen3's template with thinking off writes <think></think>: the grammar does not wait then."""
    from adaspec import reasoning_tags

    monkeypatch.setitem(reasoning_tags.REASONING_TAGS, "qwen3", ('"', "!"))
    llm = LLM(lossless_micro_pair[0], reasoning_parser="qwen3")
    tok = Tokenizer.from_dir(lossless_micro_pair[0])

    def starts(prompt) -> list[bool]:  # the reply begins as the grammar does
        params = [SamplingParams(temperature=1.0, max_tokens=5, seed=i, structured_outputs=SO(regex=MICRO_REGEX))
                  for i in range(64)]
        outs = llm.generate([prompt] * 64, params, use_tqdm=False)
        return [bool(re.match(r'(!"|"!|#[!-$])', tok.decode(o.outputs[0].token_ids))) for o in outs]

    assert all(starts(WAITING_PROMPT + [MARK]))  # closed in the prompt: held from the first token
    assert not all(starts(WAITING_PROMPT))  # open: free until the reply closes it


def test_reasoning_parser_needs_its_tags_as_single_tokens():
    with pytest.raises(ConfigError, match="'<think>' is not one token"):
        LLM("tiny", reasoning_parser="qwen3")
    with pytest.raises(ConfigError, match="reasoning_parser must be one of"):
        EngineConfig(model="tiny", reasoning_parser="granite")


def test_masks_from_the_wrong_history_stop_the_engine_loudly(lossless_micro_pair, tmp_path, monkeypatch):
    """Every verification position masked as its block's anchor (the drafts ignored): drafts the
    grammar refuses get accepted, and the request's matcher refuses them in the next step."""
    real = structured_outputs.grammar_keep_mask

    def anchors_only(rows, V, device):
        return real([RuleRow(r.rule, r.temperature, r.prompt, r.output, [], r.pending, r.history) for r in rows],
                    V, device)

    monkeypatch.setattr("adaspec.sample.logits_rules.grammar_keep_mask", anchors_only)
    with pytest.raises(RuntimeError, match="break its structured output"):
        grammar_samples(lossless_micro_pair, tmp_path)(2_000)


def test_harness_catches_masks_that_stay_in_the_grammar_but_drop_a_token(lossless_micro_pair, tmp_path, monkeypatch):
    """Verification positions that allow one token fewer than the grammar does (the highest of
    two or more): every output still follows the grammar, only the law is wrong."""
    real = structured_outputs.grammar_keep_mask

    def one_fewer(rows, V, device):
        keep = real(rows, V, device)
        for r, row in enumerate(rows):
            allowed = keep[r].nonzero().flatten()
            if row.extra and len(allowed) > 1:
                keep[r, allowed[-1]] = False
        return keep

    monkeypatch.setattr("adaspec.sample.logits_rules.grammar_keep_mask", one_fewer)
    p = lossless_pvalue(grammar_samples(lossless_micro_pair, tmp_path), exact_constrained_law(lossless_micro_pair[0]), n=N // 4)
    assert p < 1e-6


def test_a_finished_request_gives_its_matcher_back_while_its_sequence_is_still_held(monkeypatch):
    """The engine drops a finished request's grammar state (LLMEngine._finish), so its matcher
    returns to the pool even while something still holds the Sequence (a step in flight, a cache):
    the next requests of that grammar reuse the matchers instead of compiling their own."""
    monkeypatch.setattr(structured_outputs, "_pools", weakref.WeakKeyDictionary())
    eng = LLM("tiny", max_num_seqs=4).llm_engine
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=6, structured_outputs=SO(regex="[a-z]{2,8}"))
    held = run_waves_keeping_sequences(eng, params)
    assert len(held) == 12 and all(s.finished for s in held)
    pool = held[0].logits_rule.grammar.pool
    assert pool.num_free == 4  # the four matchers the first wave compiled, all back, reused since
    assert all(s.grammar_state is None for s in held)
