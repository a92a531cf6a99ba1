"""The one-kernel q/k norm, RoPE and cache write (models/qk_norm_rope_triton.py) against the eager
function it replaces (fused.qk_norm_rope_write_kv): the same q, the same keys and values in the
written slots, every other slot untouched.

Without CUDA the kernel runs in Triton's interpreter on float32 (and bf16) CPU tensors; with CUDA
the same cases run compiled."""
import pytest
import torch

from adaspec.testing import triton_kernels_or_skip

triton = triton_kernels_or_skip()

from adaspec.models import fused  # noqa: E402
from adaspec.models.qk_norm_rope_triton import (  # noqa: E402
    heads_per_program, launch, qk_norm_rope_write_kv_triton, unsupported,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _case(T, Hq, Hkv, D, dtype, norm=True, seed=0, S=40, P=64):
    """Inputs laid out as the engine's: q, k, v split views of one qkv projection; the caches
    layer views of one [layers, k/v, slots, Hkv, D] storage; unit-norm rotary tables."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(T, (Hq + 2 * Hkv) * D, generator=g) * 3).to(DEVICE, dtype)
    q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    q, k, v = q.view(T, Hq, D), k.view(T, Hkv, D), v.view(T, Hkv, D)
    angles = torch.rand(P, D // 2, generator=g) * 6.3
    cos = torch.cat([angles.cos()] * 2, -1).to(DEVICE)
    sin = torch.cat([angles.sin()] * 2, -1).to(DEVICE)
    weights = [(torch.rand(D, generator=g) + 0.5).to(DEVICE, dtype) for _ in range(2)] if norm else [None, None]
    positions = torch.randint(0, P, (T,), generator=g).to(DEVICE)
    slots = torch.randperm(S, generator=g)[:T].to(DEVICE)
    storage = torch.randn(2, 2, S, Hkv, D, generator=g).to(DEVICE, dtype)
    return (q, k, v, positions, cos, sin, *weights, 1e-6), storage, slots


def _both(args, storage, slots, layer=1):
    want = storage.clone()
    q_want = fused.qk_norm_rope_write_kv(*args, want[layer, 0], want[layer, 1], slots)
    got = storage.clone()
    q_got = qk_norm_rope_write_kv_triton(*args, got[layer, 0], got[layer, 1], slots)
    return q_got, q_want, got, want


@pytest.mark.parametrize("T,Hq,Hkv,D,norm", [(1, 4, 2, 16, True), (8, 4, 2, 16, True), (5, 6, 3, 32, True),
                                             (3, 4, 4, 8, False)])
def test_float32_equals_the_eager_function(T, Hq, Hkv, D, norm):
    args, storage, slots = _case(T, Hq, Hkv, D, torch.float32, norm)
    q_got, q_want, got, want = _both(args, storage, slots)
    torch.testing.assert_close(q_got, q_want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    untouched = torch.ones(storage.shape[2], dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert torch.equal(got[:, :, untouched], storage[:, :, untouched])  # other slots, and the other layer
    assert torch.equal(got[0], storage[0])
    assert not torch.equal(got[1, :, slots], storage[1, :, slots])


@pytest.mark.parametrize("T,Hq,Hkv,hb", [(5, 6, 3, 2), (5, 6, 3, 4), (3, 16, 8, 8), (4, 0, 3, 2), (70, 4, 2, None)])
def test_heads_grouped_in_a_program_equal_the_eager_function(T, Hq, Hkv, hb):
    """Programs that take a group of heads (heads_per_program: many rows), with groups that do not
    divide the heads (masked), and keys alone (Hq = 0): what one head a program writes. hb None: the
    launch's own choice, grouped at 70 rows."""
    args, storage, slots = _case(T, Hq, Hkv, 16, torch.float32, seed=T + Hq, S=2 * T + 8)
    want = storage.clone()
    q_want = fused.qk_norm_rope_write_kv(*args, want[1, 0], want[1, 1], slots)
    got = storage.clone()
    q_got = launch(*args, got[1, 0], got[1, 1], slots, heads_per_prog=hb)
    torch.testing.assert_close(q_got, q_want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    untouched = torch.ones(storage.shape[2], dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert torch.equal(got[:, :, untouched], storage[:, :, untouched])


def test_many_rows_group_heads_and_few_rows_do_not():
    assert heads_per_program(8, 24) == 1  # decode at a few requests: a program per head
    assert heads_per_program(2048, 24) == 8
    assert heads_per_program(2048, 6) == 8 and heads_per_program(2048, 2) == 2  # never more than the heads
    args, storage, slots = _case(3, 4, 2, 16, torch.float32)
    for bad in (0, 3):
        with pytest.raises(ValueError, match="power of two"):
            launch(*args, storage[1, 0], storage[1, 1], slots, heads_per_prog=bad)


def test_bfloat16_agrees_to_a_rounding_step():
    """The roundings of the eager bf16 function are replayed; on CUDA the mean's summation order
    and the rsqrt can still move a value by one bf16 step (at the head's largest magnitude). Triton's interpreter (no GPU) truncates
    float32 to bf16 instead of rounding it, each of the kernel's three roundings then losing up to
    a step: 4 steps there, without the bit-equality count."""
    args, storage, slots = _case(6, 4, 2, 32, torch.bfloat16, seed=3)
    q_got, q_want, got, want = _both(args, storage, slots)
    steps = 1 if DEVICE.type == "cuda" else 4
    for a, b in ((q_got, q_want), (got, want)):
        # a step at the head's scale: where RoPE's two terms cancel, an input rounding is far
        # larger than the small output's own step
        step = b.float().abs().amax(-1, keepdim=True) * 2.0 ** -7
        assert ((a.float() - b.float()).abs() <= steps * step).all()
        if DEVICE.type == "cuda":
            assert (a == b).float().mean() > 0.95  # nearly all bit-equal


def test_a_wrong_result_is_caught():
    """The comparison above can fail: RoPE at the wrong positions gives other queries and keys."""
    args, storage, slots = _case(8, 4, 2, 16, torch.float32, seed=1)
    shifted = (args[0], args[1], args[2], (args[3] + 1) % 64, *args[4:])
    want = storage.clone()
    q_want = fused.qk_norm_rope_write_kv(*args, want[1, 0], want[1, 1], slots)
    got = storage.clone()
    q_got = qk_norm_rope_write_kv_triton(*shifted, got[1, 0], got[1, 1], slots)
    assert not torch.allclose(q_got, q_want, rtol=1e-3, atol=1e-3)
    assert not torch.allclose(got, want, rtol=1e-3, atol=1e-3)


def test_it_names_what_it_cannot_take():
    args, storage, slots = _case(4, 4, 2, 16, torch.float32)
    q, k, v, positions, cos, sin = args[:6]
    kc, vc = storage[1, 0], storage[1, 1]
    assert unsupported(q, k, v, positions, cos, sin, kc, vc, slots) is None
    assert "head_dim" in unsupported(q[..., :12], k[..., :12], v[..., :12], positions, cos, sin, kc, vc, slots)
    assert "rows" in unsupported(q, k, v, positions[:3], cos, sin, kc, vc, slots)
    assert "[rows, heads" in unsupported(q.unsqueeze(0), k, v, positions, cos, sin, kc, vc, slots)
    with pytest.raises(ValueError, match="rows"):
        qk_norm_rope_write_kv_triton(q, k, v, positions, cos, sin, None, None, 1e-6, kc, vc, slots[:2])
    with pytest.raises(ValueError, match="q_weight and k_weight must both be given"):
        qk_norm_rope_write_kv_triton(q, k, v, positions, cos, sin, args[6], None, 1e-6, kc, vc, slots)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors under the interpreter; on CUDA: tests/engine/test_gpu.py")
@pytest.mark.parametrize("spec,grouped", [(False, False), (True, False), (True, True)],
                         ids=["plain", "adaptive", "adaptive-grouped"])
def test_the_engine_gives_the_same_tokens_with_the_kernel(spec, grouped, monkeypatch, tmp_path):
    """ADASPEC_FUSED_KV_WRITE=triton through the engine (target layers, the drafter's block and
    its context), here on the CPU under the interpreter: the tokens of the separate writes, and
    the kernel ran. grouped: every call takes heads in groups (heads_per_program's choice from
    GROUPED_FROM_ROWS rows, here from one), as a loaded GPU step's calls do."""
    from adaspec import LLM, SamplingParams
    from adaspec.models import qk_norm_rope_triton
    from adaspec.testing import pin_cost_tables

    if grouped:
        monkeypatch.setattr(qk_norm_rope_triton, "GROUPED_FROM_ROWS", 1)
    calls = []
    kernel = qk_norm_rope_triton.launch
    monkeypatch.setattr(fused, "_kernel_device", lambda t: True)
    monkeypatch.setattr(qk_norm_rope_triton, "launch",
                        lambda *a: calls.append(tuple(a[0].shape[:2])) or kernel(*a))
    prompts = [list(range(3, 20)), [5, 9, 2]]
    p = SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True)
    cfg = None
    if spec:
        cfg = {"method": "dspark", "num_speculative_tokens": 4, "enable_adaptive_verification": True,
               "cost_model_cache_dir": str(tmp_path)}
    got = {}
    old = fused.set_fused_kv_write(False)
    try:
        for flag in (False, "triton"):
            fused.set_fused_kv_write(flag)
            llm = LLM("tiny", device="cpu", speculative_config=cfg, max_num_seqs=4)
            if spec:
                pin_cost_tables(llm)
            got[flag] = [o.outputs[0].token_ids for o in llm.generate(prompts, p)]
    finally:
        fused.set_fused_kv_write(old)
    assert got["triton"] == got[False]
    assert calls and max(rows for rows, _ in calls) >= 17  # prefill rows and decode / verify rows went through it
    # the drafter's context (keys and values without queries) too, with a speculative engine only
    assert any(heads == 0 for _, heads in calls) == spec


@pytest.mark.parametrize("norm", [True, False])
def test_keys_and_values_alone_equal_the_separate_ops(norm):
    """No query heads (the drafter's context, fused.kv_written_by_kernel): a grid of key/value heads only
    writes what the k norm, RoPE and index_copy_ write, and returns an empty q."""
    args, storage, slots = _case(5, 4, 2, 16, torch.float32, norm, seed=4)
    _, k, v, positions, cos, sin, _, k_weight, eps = args
    want = storage.clone()
    fused.qk_norm_rope_write_kv(k[:, :0], k, v, positions, cos, sin, k_weight, k_weight, eps, want[1, 0], want[1, 1],
                                slots)
    assert not torch.equal(want, storage)
    got = storage.clone()
    q = qk_norm_rope_write_kv_triton(k[:, :0], k, v, positions, cos, sin, k_weight, k_weight, eps,
                                     got[1, 0], got[1, 1], slots)
    assert q.shape == (5, 0, 16)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
