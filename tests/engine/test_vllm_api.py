"""Where vLLM users' offline code meets adaspec's (a review of vLLM's LLM / SamplingParams /
engine arguments): prompt dicts, vLLM's fields adaspec does not implement, neutral engine
arguments and dtype spellings."""
import pytest
from hypothesis import given, settings, strategies as st
import torch

from adaspec import LLM, SamplingParams, TextPrompt, TokensPrompt
from adaspec.errors import ConfigError, InvalidRequestError
from adaspec.sampling_params import UNSUPPORTED_UNLESS

ARGS = dict(device="cpu", max_model_len=128, num_kv_blocks=32)


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", **ARGS)


def test_prompt_dicts_are_prompts(llm):
    greedy = SamplingParams(temperature=0, max_tokens=6)
    ids = llm.get_tokenizer().encode("def f():")
    want = llm.generate("def f():", greedy)[0].outputs[0].token_ids
    one = llm.generate(TextPrompt(prompt="def f():"), greedy)
    assert len(one) == 1 and one[0].outputs[0].token_ids == want  # a dict is one prompt, not its keys
    many = llm.generate([{"prompt": "def f():"}, TokensPrompt(prompt_token_ids=ids), ids], greedy)
    assert [o.outputs[0].token_ids for o in many] == [want] * 3
    assert many[1].prompt_token_ids == ids
    for bad, needle in (({"prompt": "x", "multi_modal_data": {}}, "multi_modal_data"),
                        ({"prompt": "x", "prompt_token_ids": [1]}, "not both"), ({}, "not both")):
        with pytest.raises(InvalidRequestError, match=needle):
            llm.generate(bad, greedy)
    assert not llm.llm_engine.has_unfinished_requests()


def test_vllm_fields_at_their_neutral_values_are_accepted_and_others_named():
    # vLLM's defaults, and the values model cards write for them when they mean "off"
    SamplingParams(presence_penalty=0, frequency_penalty=0.0, repetition_penalty=1.0, min_tokens=0, min_p=0.0,
                   logit_bias={}, bad_words=[], best_of=1, spaces_between_special_tokens=True)
    for name, value in (("logits_processors", [print]),
                        ("best_of", 2), ("guided_decoding", {"json": {}}),
                        ("spaces_between_special_tokens", False)):
        with pytest.raises(InvalidRequestError, match=f"{name} is not supported by adaspec") as e:
            SamplingParams(**{name: value})
        assert e.value.param == name
    assert set(UNSUPPORTED_UNLESS) <= set(SamplingParams.__dataclass_fields__)


def test_spoiled_after_construction_the_request_alone_fails(llm):
    p = SamplingParams(max_tokens=2)
    p.repetition_penalty = -1.2
    with pytest.raises(InvalidRequestError, match="repetition_penalty"):
        llm.llm_engine.add_request("spoiled", "x", p)
    assert not llm.llm_engine.has_unfinished_requests()


def test_vllm_engine_arguments_that_ask_for_nothing_are_accepted():
    llm = LLM("tiny", trust_remote_code=True, disable_log_stats=True, enable_prefix_caching=False, quantization=None,
              kv_cache_dtype="auto", tokenizer_mode="auto", revision=None, dtype="float", **ARGS)
    assert llm.llm_engine.config.dtype == "float32"
    assert LLM("tiny", dtype=torch.float32, **ARGS).llm_engine.config.dtype == "float32"
    for kw, needle in ((dict(enable_prefix_caching=True), "no prefix cache"), (dict(quantization="awq"), "quantization"),
                       (dict(kv_cache_dtype="fp8"), "kv_cache_dtype"), (dict(dtype="int8"), "dtype must be one of")):
        with pytest.raises(ConfigError, match=needle):
            LLM("tiny", **ARGS, **kw)


def test_chat_runs_each_conversation_through_the_template(llm):
    greedy = SamplingParams(temperature=0, max_tokens=4)
    tok = llm.get_tokenizer()
    hi, bye = [{"role": "user", "content": "hi"}], [{"role": "user", "content": "bye"}]
    ids = tok.apply_chat_template(hi, tokenize=True)
    assert ids == tok.encode(tok.apply_chat_template(hi))
    one = llm.chat(hi, greedy)
    assert len(one) == 1 and one[0].prompt_token_ids == ids and one[0].prompt == tok.apply_chat_template(hi)
    assert one[0].outputs[0].token_ids == llm.generate(TokensPrompt(prompt_token_ids=ids), greedy)[0].outputs[0].token_ids
    both = llm.chat([hi, bye], greedy)
    assert [o.prompt for o in both] == [tok.apply_chat_template(c) for c in (hi, bye)]
    no_prompt = llm.chat(hi, greedy, add_generation_prompt=False)[0].prompt
    assert no_prompt == tok.apply_chat_template(hi, add_generation_prompt=False) != one[0].prompt
    for bad in ([], "hi", [["not a dict"]]):
        with pytest.raises(InvalidRequestError, match="messages|conversation"):
            llm.chat(bad, greedy)


def test_template_keywords_reach_the_template():
    from adaspec.models.registry import resolve_model_path
    from adaspec.models.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(resolve_model_path("tiny"))
    tok.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}{% if enable_thinking %}<think>{% endif %}"
    msgs = [{"role": "user", "content": "q"}]
    assert tok.apply_chat_template(msgs, enable_thinking=True) == "q<think>"
    assert tok.apply_chat_template(msgs, enable_thinking=False) == "q"


def _tiny_with_generation_config(tmp_path, **recommended):
    import json
    import shutil

    from adaspec.models.registry import resolve_model_path

    d = tmp_path / "tiny"
    shutil.copytree(resolve_model_path("tiny"), d)
    g = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps({**g, **recommended}))
    return d


def test_the_models_recommended_sampling_is_the_default(tmp_path):
    """vLLM's generation_config "auto": temperature / top_p / top_k from generation_config.json are
    what a request without sampling params gets, a repetition penalty and min_p included."""
    d = _tiny_with_generation_config(tmp_path, temperature=0.0, top_k=20, repetition_penalty=1.5, max_new_tokens=12)
    llm = LLM(str(d), **ARGS)
    sp = llm.get_default_sampling_params()
    # greedy drops top_k (it cannot change an argmax), as vLLM's SamplingParams does
    assert (sp.temperature, sp.top_k, sp.top_p, sp.max_tokens, sp.repetition_penalty) == (0.0, 0, 1.0, 12, 1.5)
    assert llm.llm_engine.sampling_defaults == {"temperature": 0.0, "top_k": 20, "repetition_penalty": 1.5,
                                                "max_tokens": 12}
    out = llm.generate("def f():")[0].outputs[0]
    assert len(out.token_ids) <= 12 and out.token_ids == llm.generate(
        "def f():", SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.5))[0].outputs[0].token_ids
    assert out.token_ids != llm.generate("def f():", SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].token_ids
    own = LLM(str(d), generation_config="vllm", **ARGS).get_default_sampling_params()
    assert (own.temperature, own.top_k, own.max_tokens) == (1.0, 0, 16)
    assert LLM("tiny", **ARGS).llm_engine.sampling_defaults == {}  # do_sample alone recommends nothing
    with pytest.raises(ConfigError, match="no generation_config.json there"):
        LLM(str(d), generation_config=str(tmp_path / "nowhere"), **ARGS)
    bad = _tiny_with_generation_config(tmp_path / "bad", temperature=-1)
    with pytest.raises(ConfigError, match="temperature must be >= 0"):
        LLM(str(bad), **ARGS)


def test_logprobs_are_vllm_logprob_objects_that_read_as_floats(llm):
    from adaspec.outputs import Logprob

    greedy = llm.generate("def f():", SamplingParams(temperature=0, max_tokens=5, logprobs=3))[0].outputs[0]
    raw = llm.llm_engine  # the engine's own outputs keep plain floats: compare against a run of it
    raw.add_request("raw", "def f():", SamplingParams(temperature=0, max_tokens=5, logprobs=3))
    plain = None
    while raw.has_unfinished_requests():
        for o in raw.step():
            plain = o.outputs[0]
    assert greedy.logprobs == plain.logprobs  # the same numbers, read as floats
    for tid, d in zip(greedy.token_ids, greedy.logprobs):
        assert all(isinstance(v, Logprob) and isinstance(v, float) for v in d.values())
        ranked = sorted(d.values(), key=lambda v: -v.logprob)
        assert [v.rank for v in ranked] == [1, 2, 3]  # greedy: the chosen token is the likeliest
        assert d[tid].rank == 1 and d[tid].decoded_token == llm.get_tokenizer().decode([tid])
    assert greedy.cumulative_logprob == pytest.approx(sum(d[t] for t, d in zip(greedy.token_ids, greedy.logprobs)))
    assert greedy.finished() is True
    # a sampled token outside the top 1: an entry of its own, rank not computed
    sampled = llm.generate("import ", SamplingParams(temperature=5.0, max_tokens=40, logprobs=1, seed=1))[0].outputs[0]
    outside = [(t, d) for t, d in zip(sampled.token_ids, sampled.logprobs) if len(d) == 2]
    assert outside, "at T = 5 some token falls outside the top 1"
    for t, d in outside:
        assert d[t].rank is None and [v.rank for k, v in d.items() if k != t] == [1]
    assert llm.generate("x", SamplingParams(max_tokens=2))[0].outputs[0].cumulative_logprob is None
    # logprobs=0 asks for the chosen token only: a greedy one is the argmax, rank 1
    only = llm.generate("def f():", SamplingParams(temperature=0, max_tokens=3, logprobs=0))[0].outputs[0]
    assert [[v.rank for v in d.values()] for d in only.logprobs] == [[1]] * 3


@pytest.mark.parametrize("top_n", [0, 1, 2])
def test_a_greedy_pick_a_rule_moved_is_not_ranked_first(llm, top_n):
    """Logprobs are the raw model's (before bias and penalties), so a greedy token that a logit
    bias made the pick is not the raw argmax: its rank is unknown (None), not 1 (it was 1)."""
    plain = llm.generate("def f():", SamplingParams(temperature=0, max_tokens=1, logprobs=3))[0].outputs[0]
    low = min(plain.logprobs[0], key=lambda t: plain.logprobs[0][t])  # the 3rd likeliest
    other = next(t for t in range(50, 400) if t not in plain.logprobs[0])  # outside the raw top 3
    for forced in (low, other):
        params = SamplingParams(temperature=0, max_tokens=1, logprobs=top_n, logit_bias={forced: 100.0})
        d = llm.generate("def f():", params)[0].outputs[0].logprobs[0]
        ranks = {t: v.rank for t, v in d.items()}
        # the 3rd likeliest or beyond, outside the top 0-2 asked for, below the last of them
        assert ranks[forced] is None and list(ranks.values()).count(1) == min(top_n, 1)


@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.integers(-6, 0), min_size=1, max_size=8), top_n=st.integers(0, 4),
       pick=st.integers(0, 7), argmax=st.booleans())
def test_chosen_rank_is_vllms_rank_wherever_it_gives_one(values, top_n, pick, argmax):
    """chosen_rank against the brute-force rank over a whole (small) vocabulary: exact where it
    answers, and it answers whenever the top n decide it."""
    from adaspec.llm import chosen_rank

    chosen = pick % len(values)
    top = sorted((v for i, v in enumerate(values) if i != chosen), reverse=True)[:top_n]
    if chosen in sorted(range(len(values)), key=lambda i: -values[i])[:top_n]:
        return  # inside the top n: ranked by its place there, not by chosen_rank
    truth = 1 + sum(v > values[chosen] for v in values)
    is_argmax = argmax and truth == 1  # what the engine can know: a greedy pick no rule moved
    got = chosen_rank(values[chosen], top, is_argmax)
    assert got is None or got == truth
    if (top and values[chosen] >= top[-1]) or (not top and is_argmax):
        assert got == truth


def test_the_tokenizer_reads_as_a_transformers_one_where_users_reach_for_it(llm):
    tok = llm.get_tokenizer()
    ids = tok.encode("def f():")
    assert len(tok) == tok.vocab_size and tok.eos_token_id in tok.eos_token_ids
    assert tok.convert_ids_to_tokens(ids) == [tok.id_to_token(i) for i in ids]
    assert tok.convert_ids_to_tokens(ids[0]) == tok.id_to_token(ids[0])
    assert tok.batch_decode([ids, ids[:1]]) == [tok.decode(ids), tok.decode(ids[:1])]


def test_chat_reads_openai_content_parts_and_refuses_what_it_cannot(llm):
    greedy = SamplingParams(temperature=0, max_tokens=3)
    plain = llm.chat([{"role": "user", "content": "hi there"}], greedy)[0]
    parts = llm.chat([{"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}],
                     greedy)[0]
    assert parts.prompt_token_ids == plain.prompt_token_ids
    with pytest.raises(InvalidRequestError, match=r"messages\[0\].content") as e:
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], greedy)
    assert e.value.param == "messages[0].content"
    with pytest.raises(InvalidRequestError, match="set by adaspec itself"):
        llm.chat([{"role": "user", "content": "q"}], greedy, chat_template_kwargs={"add_generation_prompt": False})


def test_generation_config_of_the_wrong_type_is_a_config_error():
    for bad in (None, 5, ""):
        with pytest.raises(ConfigError, match="generation_config must be 'auto', 'vllm' or a directory"):
            LLM("tiny", generation_config=bad, **ARGS)


def test_the_generate_command_takes_the_models_recommended_sampling(tmp_path, capsys):
    import json

    from adaspec.cli import main

    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3}))
    base = ["generate", "tiny", "--prompt", "def f():", "--device", "cpu", "--json"]
    for extra, want in (([], 64), (["--generation-config", str(tmp_path)], 3),
                        (["--generation-config", str(tmp_path), "--max-tokens", "5"], 5)):
        assert main(base + extra) == 0
        out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert len(out["token_ids"]) == want and out["finish_reason"] == "length", extra


def test_use_tqdm_takes_a_bar_class_as_vllm_does(llm):
    made = []

    class Bar:
        def __init__(self, **kw):
            made.append(kw)
            self.n = 0

        def update(self, k):
            self.n += k

        def close(self):
            made.append(self.n)

    llm.generate(["a", "b"], SamplingParams(max_tokens=1), use_tqdm=Bar)
    assert made == [{"total": 2, "desc": "generate", "unit": "req"}, 2]


@pytest.mark.parametrize("fails_in", ["bar", "update"])
def test_a_generate_call_that_fails_leaves_no_request_running(llm, fails_in):
    """An exception out of a generate call (here its progress bar, as a Ctrl-C would) aborts the
    call's requests: the next call does not first run them to their end (it did)."""
    class Interrupted(Exception):
        pass

    class Bar:
        def __init__(self, **kw):
            if fails_in == "bar":
                raise Interrupted

        def update(self, k):
            raise Interrupted

    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    with pytest.raises(Interrupted):
        llm.generate(["a", "b", "c", "d"], [SamplingParams(max_tokens=1)] + [long] * 3, use_tqdm=Bar)
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests() and engine.num_running() == engine.num_waiting() == 0
    out = llm.generate("def f():", SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3 and out.outputs[0].finish_reason == "length"


def test_a_greedy_request_keeps_no_filter():
    sp = SamplingParams(temperature=0, top_p=0.5, top_k=3)
    assert (sp.temperature, sp.top_p, sp.top_k) == (0.0, 1.0, 0)
    assert (SamplingParams(temperature=0.5, top_p=0.5, top_k=3).top_k, SamplingParams(top_p=0.5).top_p) == (3, 0.5)


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens():
    """vLLM's truncate_prompt_tokens: the last k prompt tokens (-1: max_model_len) are the prompt."""
    llm = LLM("tiny", max_model_len=64)
    long = list(range(5, 105))
    greedy = dict(temperature=0, max_tokens=5, ignore_eos=True)
    out = llm.generate([long], SamplingParams(**greedy, truncate_prompt_tokens=7))[0]
    assert out.prompt_token_ids == long[-7:]
    assert out.outputs[0].token_ids == llm.generate([long[-7:]], SamplingParams(**greedy))[0].outputs[0].token_ids
    with pytest.raises(InvalidRequestError, match="max_model_len is 64"):  # -1 keeps max_model_len: no room left
        llm.generate([long], SamplingParams(**greedy, truncate_prompt_tokens=-1))
    for bad in (0, -2, 1.5, True):
        with pytest.raises(InvalidRequestError, match="truncate_prompt_tokens must be") as e:
            SamplingParams(truncate_prompt_tokens=bad)
        assert e.value.param == "truncate_prompt_tokens"


def test_numpy_integers_are_token_ids(llm):
    """Token ids out of numpy (a list of np.int64, as `list(array)` gives) are taken as ints, in
    the prompt and in stop_token_ids; bools and floats stay refused."""
    import numpy as np

    greedy = dict(temperature=0, max_tokens=4, ignore_eos=True)
    ref = llm.generate([[5, 6, 7]], SamplingParams(**greedy), use_tqdm=False)[0]
    stop = ref.outputs[0].token_ids[1]
    got = llm.generate(list(np.array([5, 6, 7])), SamplingParams(**greedy, stop_token_ids=list(np.array([stop]))),
                       use_tqdm=False)[0]
    assert got.prompt_token_ids == [5, 6, 7] and all(type(t) is int for t in got.prompt_token_ids)
    cut = ref.outputs[0].token_ids.index(stop) + 1
    assert got.outputs[0].token_ids == ref.outputs[0].token_ids[:cut] and got.outputs[0].stop_reason == stop
    for bad in ([True, 2], [1.0, 2]):
        with pytest.raises(InvalidRequestError, match="list of token ids"):
            llm.generate([bad], SamplingParams(max_tokens=1), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[np.float64(3.0)])
