"""train/self_distill.py: the target's own continuations (drafter training data, eval sets).

The loop's greedy tokens must be the target's argmax over the whole prefix (checked against a
full recompute without a cache), whatever the attention backend: the pair build runs it on the
engine's backend for the device (the Triton paged kernel on CUDA), the CPU on plain torch.
"""
from __future__ import annotations

import pytest
import torch

from adaspec.models.loader import load_target
from adaspec.train.self_distill import sample_continuations, sample_ragged

PROMPTS = [[5, 9, 2], [7], [3, 3, 3, 3, 3, 1, 8], [11, 4]]  # ragged: one batch mixes lengths
GEN = 9


def greedy_by_recompute(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model.compute_logits(model.forward_dense(torch.tensor([ids]))[:, -1])
            ids.append(int(logits.argmax(-1)))
    return ids


@pytest.fixture(scope="module")
def model(micro_qwen3):
    m, _ = load_target(micro_qwen3)
    return m


@pytest.mark.parametrize("backend", ["reference", "paged_torch", "auto"])
def test_greedy_rows_are_the_targets_argmax_continuations(model, backend, monkeypatch):
    """paged_torch: the Triton kernel's metadata read by its contract in torch (what the graphed
    step does on the CPU), so the backend argument really reaches the attention; auto: the CPU's
    choice (plain torch)."""
    import adaspec.train.self_distill as sd

    build, seen = sd.build_attention_metadata, set()

    def paged_torch_meta(backend_name, *args):
        seen.add(backend_name)
        if backend_name != "paged_torch":
            return build(backend_name, *args)
        meta = build("triton", *args)
        meta.backend = "paged_torch"
        return meta

    monkeypatch.setattr(sd, "build_attention_metadata", paged_torch_meta)
    want = [greedy_by_recompute(model, p, GEN) for p in PROMPTS]
    got = sample_ragged(model, PROMPTS, GEN, temperature=0.0, batch_size=3, attention_backend=backend)
    assert got == want
    assert seen == {"reference" if backend == "auto" else backend}


def test_sampled_rows_follow_the_seed_and_keep_the_prompts(model):
    a = sample_ragged(model, PROMPTS, GEN, temperature=1.0, seed=3, batch_size=4)
    b = sample_ragged(model, PROMPTS, GEN, temperature=1.0, seed=3, batch_size=4)
    c = sample_ragged(model, PROMPTS, GEN, temperature=1.0, seed=4, batch_size=4)
    assert a == b and a != c
    assert [r[:len(p)] for r, p in zip(a, PROMPTS)] == PROMPTS and all(len(r) == len(p) + GEN for r, p in zip(a, PROMPTS))
    rect = sample_continuations(model, torch.tensor([[5, 9, 2], [1, 2, 3]]), GEN, temperature=0.0)
    assert rect.shape == (2, 3 + GEN) and rect[0].tolist() == greedy_by_recompute(model, [5, 9, 2], GEN)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_graphed_decode_gives_the_eager_loops_rows(model, temperature):
    """The decode steps as the graph's forward over its static buffers (run eagerly here: the same
    buffers, block tables, positions and input tokens as a CUDA replay) give the eager loop's rows,
    token for token, for ragged prompts over two batches (3 rows, then 1)."""
    want = sample_ragged(model, PROMPTS, GEN, temperature=temperature, seed=5, batch_size=3, cuda_graphs=False)
    got = sample_ragged(model, PROMPTS, GEN, temperature=temperature, seed=5, batch_size=3, cuda_graphs="eager")
    assert got == want
    if temperature == 0.0:
        assert got == [greedy_by_recompute(model, p, GEN) for p in PROMPTS]


def test_a_failed_capture_decodes_the_batch_eagerly(model, monkeypatch, capsys):
    """The pair build must not be lost to a graph capture (out of memory, say): the batch decodes
    eagerly, with a warning naming the failure."""
    from adaspec.engine.cuda_graphs import GraphedForward

    def no_capture(self, eager=False):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(GraphedForward, "capture", no_capture)
    got = sample_ragged(model, PROMPTS, GEN, temperature=0.0, batch_size=4, cuda_graphs="eager")
    assert got == [greedy_by_recompute(model, p, GEN) for p in PROMPTS]
    err = capsys.readouterr().err
    assert "capturing the decode graph of 4 rows failed (OutOfMemoryError: CUDA out of memory (simulated))" in err


def test_card_samples_are_greedy_continuations_cut_at_the_first_eos(model):
    """MODEL_CARD.md's samples (train/card.greedy_completions) decode through this loop, one batch:
    each prompt's greedy continuation, cut before its first EOS, and none past the context length."""
    from types import SimpleNamespace

    from adaspec.train.card import greedy_completions

    texts = {f"p{i}": p for i, p in enumerate(PROMPTS)}
    full = [greedy_by_recompute(model, p, GEN)[len(p):] for p in PROMPTS]
    eos = full[0][3]  # the first prompt's fourth token: its sample ends before it

    class Tok:
        def encode(self, text, add_special_tokens=False):
            return SimpleNamespace(ids=texts[text])

        def token_to_id(self, name):
            return eos if name == "<|endoftext|>" else None

        def decode(self, ids, skip_special_tokens=True):
            return ",".join(map(str, ids))

    got = greedy_completions(model, Tok(), list(texts), GEN)
    assert got == [",".join(map(str, f[:f.index(eos)] if eos in f else f)) for f in full]
    assert got[0] == ",".join(map(str, full[0][:3]))
    limit = model.config.max_position_embeddings
    texts["long"] = [3] * (limit - 2)
    assert len(greedy_completions(model, Tok(), ["long"], GEN)[0].split(",")) <= 2


def test_cuda_graphs_takes_true_false_or_eager(model):
    with pytest.raises(ValueError, match="cuda_graphs must be True, False or 'eager'"):
        sample_ragged(model, PROMPTS, 2, cuda_graphs="yes")


def test_an_unknown_backend_is_refused_by_name(model):
    with pytest.raises(Exception, match="varlen"):
        sample_ragged(model, PROMPTS, 2, temperature=0.0, attention_backend="varlen")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_triton_backend_gives_the_reference_backends_greedy_rows_on_gpu(micro_qwen3):
    """bf16 on the GPU: the two kernels' sums differ in order, so a near tie may flip a token;
    the rows must still agree almost everywhere."""
    m, _ = load_target(micro_qwen3, dtype="bfloat16", device="cuda")
    prompts = [[(7 * i + j) % 200 + 1 for j in range(3 + i % 11)] for i in range(64)]
    ref = sample_ragged(m, prompts, 24, temperature=0.0, batch_size=64, attention_backend="reference")
    tri = sample_ragged(m, prompts, 24, temperature=0.0, batch_size=64, attention_backend="auto")
    same = sum(r == t for r, t in zip(ref, tri))
    assert same >= 0.9 * len(prompts), f"{same} of {len(prompts)} rows equal"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_decode_graph_gives_the_eager_loops_rows_on_gpu(micro_qwen3):
    """A captured graph of the decode step against the eager loop, on the same Triton kernel:
    greedy rows agree (a near tie may flip a token, as the kernels' split counts may differ), and
    sampled rows with one seed are the eager loop's where the greedy ones are."""
    m, _ = load_target(micro_qwen3, dtype="bfloat16", device="cuda")
    prompts = [[(7 * i + j) % 200 + 1 for j in range(3 + i % 11)] for i in range(64)]
    eager = sample_ragged(m, prompts, 24, temperature=0.0, batch_size=48, cuda_graphs=False)
    graphed = sample_ragged(m, prompts, 24, temperature=0.0, batch_size=48)
    same = sum(a == b for a, b in zip(eager, graphed))
    assert same >= 0.9 * len(prompts), f"{same} of {len(prompts)} rows equal"
    eager = sample_ragged(m, prompts, 24, temperature=1.0, seed=2, batch_size=48, cuda_graphs=False)
    graphed = sample_ragged(m, prompts, 24, temperature=1.0, seed=2, batch_size=48)
    same = sum(a == b for a, b in zip(eager, graphed))
    assert same >= 0.9 * len(prompts), f"{same} of {len(prompts)} sampled rows equal"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_decode_loop_does_not_sync_per_step_on_gpu(micro_qwen3):
    """The loop's syncs (the prompts' upload, the decode graph's capture, the tokens read back at
    the end) must not grow with the number of decode steps: a per-step sync keeps the host from
    running ahead of the GPU. (Torch's sync debug mode does not flag event waits: the graph's
    pinned input mirrors wait for their copies of two steps before, which bounds how far the host
    runs ahead, and are not counted here.) 12 and 20 steps give the batch the same cache width (2 blocks of 16
    for prompts of at most 7 tokens), so the kernels and the graph are alike. Measured on the H100
    (BENCHMARKS.md, run 53): 7 syncs at 20 steps against 6 at 12 (and 7 against 6 at 12 and 4 steps
    in run 52): one more whatever the difference in steps, where a sync per step gives 8 more; where
    the one comes from was not found (the 20 steps take the short prompts' rows past their first
    cache block, which the 12 do not), so the bound allows it and fails a per-step sync."""
    import warnings

    m, _ = load_target(micro_qwen3, dtype="bfloat16", device="cuda")
    prompts = [[(7 * i + j) % 200 + 1 for j in range(3 + i % 5)] for i in range(16)]
    sample_ragged(m, prompts, 12, temperature=1.0, batch_size=16)  # warm-up: kernels compile outside the count

    def syncs(gen_len):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                sample_ragged(m, prompts, gen_len, temperature=1.0, batch_size=16)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        return sum("synchroniz" in str(w.message) for w in caught)

    extra = syncs(20) - syncs(12)
    assert extra <= 2, f"{extra} more syncs for 8 more decode steps: a sync per step?"


def test_auto_falls_back_to_the_reference_attention_when_its_kernel_fails(model, monkeypatch, capsys):
    """The pair build runs minutes on a machine that keeps nothing: a kernel failure of the backend
    "auto" chose must cost a slower decode, not the build. An explicit backend still raises."""
    import adaspec.engine.llm_engine as llm_engine
    import adaspec.train.self_distill as sd

    run_batch = sd._sample_batch

    def kernel_fails(*args, **kwargs):
        if args[-1] != "reference":
            raise RuntimeError("no kernel image is available")
        return run_batch(*args, **kwargs)

    monkeypatch.setattr(sd, "_sample_batch", kernel_fails)
    monkeypatch.setattr(llm_engine, "choose_attention_backend", lambda name, device, dtype: "triton")
    want = [greedy_by_recompute(model, p, GEN) for p in PROMPTS]
    assert sample_ragged(model, PROMPTS, GEN, temperature=0.0, batch_size=3) == want
    assert "the triton attention failed (RuntimeError: no kernel image is available)" in capsys.readouterr().err
    with pytest.raises(RuntimeError, match="no kernel image"):
        sample_ragged(model, PROMPTS, GEN, temperature=0.0, attention_backend="triton")
