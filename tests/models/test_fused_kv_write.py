"""The target's and the drafter block's cache writes inside their compiled norms and RoPE
(models/fused.qk_norm_rope_write_kv via Attention.q_with_kv_written: ADASPEC_FUSED_KV_WRITE=1; on CUDA the default is one Triton kernel, tests/models/test_qk_norm_rope_triton.py; =0 turns both off):
the same keys, values and queries as RoPE then write_kv, through the engine (plain and speculative)
and compiled by inductor with the two caches as views of one storage, written in place."""
import pytest
import torch

from adaspec import LLM, SamplingParams
from adaspec.models import fused
from adaspec.models.attention import write_kv
from adaspec.testing import pin_cost_tables


@pytest.fixture
def switch():
    old = fused.set_fused_kv_write(True)  # the setting as it was given (True, False or "triton")
    fused.set_fused_kv_write(old)
    yield fused.set_fused_kv_write
    fused.set_fused_kv_write(old)


def _inputs(S=64, T=5, Hq=4, Hkv=2, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    storage = torch.randn(3, 2, S, Hkv, D, generator=g)  # allocate_kv_caches' layout: [layers, k/v, slots, ...]
    q, k, v = (torch.randn(T, h, D, generator=g) for h in (Hq, Hkv, Hkv))
    positions = torch.randint(0, 50, (T,), generator=g)
    cos, sin = torch.randn(50, D, generator=g), torch.randn(50, D, generator=g)
    qw, kw = torch.randn(D, generator=g), torch.randn(D, generator=g)
    slots = torch.randperm(S, generator=g)[:T]
    return storage, (q, k, v, positions, cos, sin, qw, kw, 1e-6), slots


def _separate(storage, args, slots, layer=1):
    q, k, v, positions, cos, sin, qw, kw, eps = args
    q, k = fused.qk_norm_rope(q, k, positions, cos, sin, qw, kw, eps)
    write_kv(storage[layer, 0], storage[layer, 1], k, v, slots)
    return q


def test_it_writes_what_rope_then_write_kv_write():
    storage, args, slots = _inputs()
    want = storage.clone()
    q_want = _separate(want, args, slots)
    q = fused.qk_norm_rope_write_kv(*args, storage[1, 0], storage[1, 1], slots)
    assert torch.equal(q, q_want) and torch.equal(storage, want)
    assert not torch.equal(storage[1], _inputs()[0][1])  # it wrote something


def test_compiled_it_writes_the_cache_in_place():
    """What the engine runs on CUDA, here through inductor's CPU backend: the k and v caches are
    views of one storage (aliased inputs of the compiled function, both mutated), one compiled
    graph serves every layer (another storage offset) and batch size, and the writes land in the
    storage itself, every other slot untouched."""
    import torch._dynamo

    torch._dynamo.reset()
    compiled = torch.compile(fused.qk_norm_rope_write_kv, dynamic=True, fullgraph=True)
    for layer, T, seed in ((0, 5, 0), (2, 3, 1), (1, 7, 2)):
        storage, args, slots = _inputs(T=T, seed=seed)
        want = storage.clone()
        q_want = _separate(want, args, slots, layer)
        ptr = storage.data_ptr()
        q = compiled(*args, storage[layer, 0], storage[layer, 1], slots)
        assert storage.data_ptr() == ptr
        assert torch.allclose(q, q_want, atol=1e-5)
        assert torch.allclose(storage, want, atol=1e-5)
        others = torch.ones(storage.shape[2], dtype=torch.bool)
        others[slots] = False
        assert torch.equal(storage[:, :, others], want[:, :, others])  # untouched slots stay bit-equal


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "adaptive"])
def test_the_engine_gives_the_same_tokens_both_ways(spec, switch, tmp_path):
    prompts = [list(range(3, 20)), [5, 9, 2], list(range(40, 90))]
    p = SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True)
    cfg = None
    if spec:
        cfg = {"method": "dspark", "num_speculative_tokens": 4, "enable_adaptive_verification": True,
               "cost_model_cache_dir": str(tmp_path)}
    got, accepted = {}, {}
    for flag in (False, True):
        switch(flag)
        llm = LLM("tiny", device="cpu", speculative_config=cfg, max_num_seqs=4)
        if spec:  # the same tables both ways: profiled ones (timed, keyed by the switch) would pick other drafts
            pin_cost_tables(llm)
        got[flag] = [o.outputs[0].token_ids for o in llm.generate(prompts, p)]
        accepted[flag] = llm.llm_engine.stats.num_accepted_tokens
    assert got[True] == got[False]
    # the tokens would be the same whatever the drafter proposed (lossless): its block's cache
    # writes are checked by the drafts it made, which the target accepted as often both ways
    assert accepted[True] == accepted[False] and (accepted[True] > 0) == spec


def test_kv_write_in_use_names_the_fused_writes_on_cuda_only(switch):
    """The label of result files and of the cost tables' key: "fused" where the compiled function
    writes the cache (switched on, CUDA); "index_copy" when switched off and on the CPU, where
    the function runs eagerly and writes with index_copy_ as the separate path does."""
    switch(True)
    assert fused.kv_write_in_use("cuda") == "fused" and fused.kv_write_in_use(torch.device("cuda", 0)) == "fused"
    assert fused.kv_write_in_use("cpu") == "index_copy"
    switch(False)
    assert fused.kv_write_in_use("cuda") == "index_copy"


def test_the_triton_setting_is_named_on_cuda_only(switch):
    switch("triton")
    assert fused.fused_kv_write() and fused.kv_write_in_use("cuda") == "triton"
    assert fused.kv_write_in_use("cpu") == "index_copy"
    assert switch(True) == "triton"  # the previous setting comes back as it was given


@pytest.mark.parametrize("raw,want", [("1", True), ("0", False), ("triton", "triton"), (" triton ", "triton")])
def test_the_environment_switch(raw, want, monkeypatch):
    monkeypatch.setenv("ADASPEC_FUSED_KV_WRITE", raw)
    assert fused._kv_write_from_env() == want


def test_the_triton_kernel_is_the_default(monkeypatch):
    monkeypatch.delenv("ADASPEC_FUSED_KV_WRITE", raising=False)
    assert fused._kv_write_from_env() == "triton"


def test_a_bad_environment_value_is_named(monkeypatch):
    monkeypatch.setenv("ADASPEC_FUSED_KV_WRITE", "yes")
    with pytest.raises(ValueError, match="ADASPEC_FUSED_KV_WRITE must be 0, 1 or triton, got 'yes'"):
        fused._kv_write_from_env()
