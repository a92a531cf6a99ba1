"""An engine is freed with its last reference, without waiting for the cyclic garbage collector:
each one holds a KV cache (~1 GiB on a CPU, a share of the GPU's memory on CUDA) and the drafter's
another, which a reference cycle kept until a full collection (test workers that built engines back
to back grew to 23.5 GB and were killed out of memory). The speculative decoder and its graphed
step refer back to the engine (and the graphed step to the decoder) weakly."""
import gc
import sys
import weakref

import pytest
import torch

from adaspec import LLM, SamplingParams

SPECS = {
    "plain": None,
    "fixed": {"method": "dspark", "num_speculative_tokens": 3},
    "adaptive": {"method": "dspark", "enable_adaptive_verification": True},
    "measured-async": {"method": "dspark", "enable_adaptive_verification": True,
                       "adaptive_verification_step_costs": "measured"},
}


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu,
                                    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("name", list(SPECS))
def test_an_engine_dies_with_its_last_reference(name, device, tmp_path):
    """On CUDA the engines capture their graphs (the graphed speculative step holds the decoder
    and the engine through proxies), and the memory they allocated must come back with them."""
    _assert_freed(_engine_kwargs(name, device, tmp_path), device)


def test_an_engine_whose_warm_up_logged_an_exception_dies_with_its_last_reference(tmp_path, monkeypatch):
    """H100 run 65: every CUDA case above failed, the engine kept by pytest's log capture, which
    keeps a warning's record and with it its arguments: the warm-up logged the exception itself
    (llguidance missing), whose traceback's frames held the engine. The warm-up runs by default
    only with CUDA graphs; here it is asked for on the CPU, without llguidance. (One case: the
    warning is the same with or without speculation, and a speculative engine's warm-up on the
    CPU costs ~13 s of the suite.)"""
    monkeypatch.setitem(sys.modules, "llguidance", None)  # its import fails
    _assert_freed({**_engine_kwargs("plain", "cpu", tmp_path), "warm_up_requests": True}, "cpu")


def _engine_kwargs(name, device, tmp_path) -> dict:
    spec = SPECS[name]
    if spec is not None:
        spec = {**spec, "cost_model_cache_dir": str(tmp_path)}
    return dict(speculative_config=spec, async_scheduling=name.endswith("async") or None, device=device)


def _assert_freed(kw: dict, device: str) -> None:
    LLM("tiny", **kw)  # the first engine of a process may import modules whose frames outlive it
    gc.collect()
    was = gc.isenabled()
    gc.disable()  # only reference counting may free it
    try:
        before = torch.cuda.memory_allocated() if device == "cuda" else 0
        llm = LLM("tiny", **kw)
        llm.generate(["def f(x):", "import os"], SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)
        engine = weakref.ref(llm.llm_engine)
        spec_step = weakref.ref(llm.llm_engine.spec) if llm.llm_engine.spec is not None else None
        del llm
        assert engine() is None, "the engine outlived its last reference (a reference cycle or a kept log record holds it)"
        assert spec_step is None or spec_step() is None
        if device == "cuda":  # the KV caches, weights and graph buffers went with it
            left = torch.cuda.memory_allocated() - before
            assert left < 16 << 20, f"{left / 2**20:.0f} MiB of CUDA memory outlived the engine"
    finally:
        if was:
            gc.enable()
