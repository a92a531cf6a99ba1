"""The engine realizes the held-out evaluation's decoding walk, exactly: greedy decoding with fixed k
drafts at the positions the walk over the evaluation's blocks visits (drafter/eval's walk_tau, with
the engine's max_tokens caps) and accepts what those blocks accept. The evaluation scores blocks
with the training code's block forward (teacher-forced target features), the engine with its own
drafter context and batching: a context row written wrong, a position off by one or a block
misaligned shows up as a different count. It also explains why an engine realizes less than the
held-out tau, which averages over every anchor (BENCHMARKS.md, run 13)."""
import torch

from adaspec import LLM, SamplingParams
from adaspec.models.drafter import load_drafter
from adaspec.models.loader import load_target, model_dir
from adaspec.models.registry import DEFAULT_DRAFTERS
from adaspec.train.drafter_eval import load_prompts, measure_blocks, summarize

N_PROMPTS, MAX_TOKENS = 12, 40


def engine_walk(accepted, seq, n_seqs, k, max_tokens):
    """(drafting steps, accepted drafts) of decoding each sequence from its first block, the first
    token coming from the prefill and each step's drafts capped at the tokens left less one."""
    steps = total = 0
    for i in range(n_seqs):
        acc = accepted[seq == i]
        n_out, j = 1, 0
        while n_out < max_tokens:
            slots = min(k, max_tokens - n_out - 1)
            a = min(int(acc[j]), slots)
            steps += slots > 0
            total += a
            n_out += a + 1
            j += a + 1
    return steps, total


def test_engine_realizes_the_heldout_walk():
    llm = LLM("tiny", speculative_config={"method": "dspark", "num_speculative_tokens": 7}, max_num_seqs=8,
              dtype="float32")
    eng = llm.llm_engine
    prompts = load_prompts("eval-code", eng.tokenizer, limit=N_PROMPTS, max_len=256)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    st = eng.stats
    cpu = torch.device("cpu")
    target, tcfg = load_target(model_dir("tiny"), dtype="float32", device=cpu)
    drafter, _ = load_drafter(DEFAULT_DRAFTERS["tiny"], target_cfg=tcfg, dtype="float32", device=cpu)
    k = drafter.block_size
    # the target's greedy continuations, k tokens past max_tokens so that every capped block exists
    longer = LLM("tiny", dtype="float32").generate(
        prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS + k, ignore_eos=True))
    seqs = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, longer)]
    # the first drafting anchor is the first generated token (the prefill samples it)
    res = measure_blocks(target, drafter, seqs, [len(p) for p in prompts], 0.0, batch_size=4)
    steps, accepted = engine_walk(res.accepted, res.seq, len(seqs), k, MAX_TOKENS)
    assert (st.num_drafts, st.num_accepted_tokens) == (steps, accepted)
    s = summarize(res)
    assert s["tau_walk"] < s["tau"]  # positions after a rejection are the harder ones
