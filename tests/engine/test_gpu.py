"""CUDA paths (skipped without a GPU): the varlen attention backend and the engine on the device."""
import pytest
import torch

from adaspec import LLM, SamplingParams
from adaspec.models.attention import build_attention_metadata, paged_attention

pytestmark = pytest.mark.gpu


def test_varlen_backend_matches_reference():
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    Hq, Hkv, D, bs = 8, 2, 64, 16
    qlens, klens = [1, 5, 37, 8], [90, 5, 200, 33]
    tables = [[i * 20 + j for j in range(-(-k // bs))] for i, k in enumerate(klens)]
    kc = torch.randn(100 * bs, Hkv, D, device=dev, generator=g)
    vc = torch.randn(100 * bs, Hkv, D, device=dev, generator=g)
    q = torch.randn(sum(qlens), Hq, D, device=dev, generator=g)
    outs = {}
    for backend in ("reference", "varlen"):
        meta = build_attention_metadata(backend, tables, qlens, klens, None, bs, dev)
        outs[backend] = paged_attention(q.bfloat16(), kc.bfloat16(), vc.bfloat16(), meta, D**-0.5).float()
    err = (outs["varlen"] - outs["reference"]).norm() / outs["reference"].norm()
    assert err < 2e-2


def test_engine_on_cuda_matches_cpu_greedy(micro_qwen3):
    prompts = [[1, 2, 3, 4], list(range(5, 40)), [7]]
    p = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    cpu = [o.outputs[0].token_ids for o in LLM(str(micro_qwen3), device="cpu").generate(prompts, p)]
    gpu = [o.outputs[0].token_ids for o in
           LLM(str(micro_qwen3), device="cuda", dtype="float32", attention_backend="reference").generate(prompts, p)]
    assert gpu == cpu


@pytest.mark.parametrize("fused_markov", [True, False])
def test_speculative_on_cuda_equals_plain(tmp_path, fused_markov, monkeypatch):
    """Greedy speculation on CUDA gives plain decoding's tokens, drafting with the fused kernels
    (models/markov_triton.py, the default on CUDA) and with the torch Markov loop. The fused
    case first and graphs captured up to 16 requests only (the 12 prompts): with the torch-loop
    case first and the default 256, a 100 s device call ended inside that case and the fused one
    never ran (H200 run 55). Passed both ways on an H100 in run 56, which turned the kernels on."""
    from adaspec.models import markov_triton
    from adaspec.testing import make_bigram_drafter_dir, make_micro_model_dir, pin_cost_tables

    monkeypatch.setattr(markov_triton, "_enabled", fused_markov)
    monkeypatch.setattr(markov_triton, "proven", set())
    t = make_micro_model_dir(tmp_path / "t", mixing=0.02, init_std=0.3, seed=3)
    d = make_bigram_drafter_dir(tmp_path / "d", t, block_size=7)
    prompts = [list(range(1 + i, 10 + 3 * i)) for i in range(12)]
    p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = dict(device="cuda", dtype="float32", max_num_seqs=16)
    plain = [o.outputs[0].token_ids for o in LLM(str(t), **kw).generate(prompts, p)]
    for adaptive in (False, True):
        spec = {"model": str(d), "num_speculative_tokens": 7, "enable_adaptive_verification": adaptive,
                "cost_model_cache_dir": str(tmp_path / "cache")}
        llm = LLM(str(t), speculative_config=spec, **kw)
        if adaptive:  # the micro drafter costs about what its target does: profiled tables may skip every draft
            pin_cost_tables(llm)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, p)] == plain
        assert llm.llm_engine.stats.num_accepted_tokens > 0
    assert bool(markov_triton.proven) == fused_markov  # the kernels drafted (and only when switched on)


def _micro_greedy_tokens_by_setting(tmp_path, switch, settings) -> dict:
    """For each setting, switch(setting) and then the micro pair's greedy tokens, plain and with
    speculation (k = 7), in the CUDA graphs -> {setting: [plain, speculative]}; the setting that
    was in use is restored (switch returns it)."""
    from adaspec.testing import make_bigram_drafter_dir, make_micro_model_dir

    t = make_micro_model_dir(tmp_path / "t", mixing=0.02, init_std=0.3, seed=3)
    d = make_bigram_drafter_dir(tmp_path / "d", t, block_size=7)
    prompts = [list(range(1 + i, 10 + 3 * i)) for i in range(12)]
    p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = dict(device="cuda", dtype="float32", max_num_seqs=16)
    spec = {"model": str(d), "num_speculative_tokens": 7}
    old = switch(settings[0])
    try:
        got = {}
        for setting in settings:
            switch(setting)
            got[setting] = [[o.outputs[0].token_ids for o in LLM(str(t), speculative_config=cfg, **kw).generate(prompts, p)]
                            for cfg in (None, spec)]
    finally:
        switch(old)
    return got


def test_fused_kv_writes_on_cuda_equal_the_separate_ones(tmp_path):
    """The target's and the drafter block's cache writes inside their compiled norms and RoPE
    (the default; ADASPEC_FUSED_KV_WRITE=0 turns them off; models/fused.qk_norm_rope_write_kv) give the separate writes' greedy
    tokens, plain and with speculation, in the CUDA graphs."""
    from adaspec.models import fused

    got = _micro_greedy_tokens_by_setting(tmp_path, fused.set_fused_kv_write, [False, True])
    assert got[True] == got[False]
    assert got[True][0] == got[True][1]  # speculation gives plain decoding's tokens
    assert fused.ops.qk_norm_rope_write_kv.failed is None


def test_triton_kv_writes_on_cuda_equal_the_compiled_ones(tmp_path, monkeypatch):
    """The norms, RoPE and cache writes as one Triton kernel (ADASPEC_FUSED_KV_WRITE=triton,
    models/qk_norm_rope_triton.py) give the compiled function's greedy tokens (the default, equal
    to the separate writes' above), plain and with speculation, in the CUDA graphs; the kernel ran."""
    from adaspec.models import fused, qk_norm_rope_triton

    kernel, calls = qk_norm_rope_triton.launch, []
    monkeypatch.setattr(qk_norm_rope_triton, "launch", lambda *a: calls.append(1) or kernel(*a))
    got = _micro_greedy_tokens_by_setting(tmp_path, fused.set_fused_kv_write, [True, "triton"])
    assert calls
    assert got["triton"] == got[True]
    assert got["triton"][0] == got["triton"][1]  # speculation gives plain decoding's tokens
