"""adaspec/cuda_compiled.py's dispatch, on CPU: the eager function unless enabled and on a device
that compiles; a compiler failure falls back to the eager function for good, with a warning;
inputs the eager function refuses too are the caller's error, not the compiler's. (Compiled and
eager values are compared on CUDA: test_cuda_compiled_gpu.py.)"""
import logging

import pytest
import torch

from adaspec import cuda_compiled as cc


def _double(x: torch.Tensor, scale: int = 2) -> torch.Tensor:
    if x.dim() != 1:
        raise ValueError("one dimension only")
    return x * scale


@pytest.fixture
def fake_compile(monkeypatch):
    """torch.compile replaced by a recorder; the CPU counted as a compiling device; enabled."""
    calls = {"compiled": 0, "built": 0, "fail": False}

    def compile_(fn, **kwargs):
        calls["built"] += 1
        assert kwargs == {"dynamic": True, "fullgraph": True}

        def run(*a, **k):
            if calls["fail"]:
                raise RuntimeError("inductor exploded")
            calls["compiled"] += 1
            return fn(*a, **k)
        return run

    monkeypatch.setattr(torch, "compile", compile_)
    monkeypatch.setattr(cc, "_compiles_for", lambda t: True)
    monkeypatch.setattr(cc, "_enabled", True)
    return calls


def test_eager_on_cpu_even_when_enabled(monkeypatch):
    monkeypatch.setattr(cc, "_enabled", True)
    monkeypatch.setattr(torch, "compile", lambda *a, **k: pytest.fail("compiled for a CPU tensor"))
    f = cc.cuda_compiled(_double)
    assert torch.equal(f(torch.arange(3)), torch.tensor([0, 2, 4]))
    assert f.__name__ == "_double" and f.__doc__ == _double.__doc__


def test_eager_before_enable(fake_compile, monkeypatch):
    monkeypatch.setattr(cc, "_enabled", False)
    f = cc.cuda_compiled(_double)
    f(torch.arange(3))
    assert fake_compile["built"] == 0 and not cc.enabled()


def test_compiled_once_and_used_for_every_call(fake_compile):
    f = cc.cuda_compiled(_double)
    assert torch.equal(f(torch.arange(3), scale=3), torch.tensor([0, 3, 6]))
    f(torch.arange(4))
    assert fake_compile == {"compiled": 2, "built": 1, "fail": False}
    assert f.failed is None


def test_a_compiler_failure_falls_back_to_eager_for_good(fake_compile, caplog):
    f = cc.cuda_compiled(_double)
    fake_compile["fail"] = True
    with caplog.at_level(logging.WARNING, logger="adaspec"):
        assert torch.equal(f(torch.arange(3)), torch.tensor([0, 2, 4]))
    assert "inductor exploded" in f.failed and "compiling _double failed" in caplog.text
    fake_compile["fail"] = False
    f(torch.arange(3))
    assert fake_compile["compiled"] == 0  # given up: eager from now on


def test_bad_inputs_raise_and_do_not_disable_the_compiled_version(fake_compile):
    def strict(x):
        if x.dim() != 1:
            raise ValueError("one dimension only")
        return x

    f = cc.cuda_compiled(strict)
    fake_compile["fail"] = True  # the compiled call fails on bad inputs as the eager one does
    with pytest.raises(ValueError, match="one dimension only"):
        f(torch.zeros(2, 2))
    assert f.failed is None
    fake_compile["fail"] = False
    f(torch.arange(2))
    assert fake_compile["compiled"] == 1


def test_a_call_without_tensors_runs_eagerly(fake_compile):
    f = cc.cuda_compiled(lambda n: n + 1)
    assert f(1) == 2 and fake_compile["built"] == 0


def test_inside_an_outer_compile_the_function_is_traced_not_compiled_again(monkeypatch):
    """Called while another function is being compiled, the wrapper must hand fn to that trace:
    a torch.compile made then would be traced through and kept as fn itself for good."""
    real_compile = torch.compile
    built = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: built.append(fn) or fn)
    monkeypatch.setattr(cc, "_compiles_for", lambda t: True)
    monkeypatch.setattr(cc, "_enabled", True)
    f = cc.cuda_compiled(_double)
    outer = real_compile(lambda x: f(x) + 1, backend="eager", fullgraph=True)
    assert torch.equal(outer(torch.arange(3)), torch.tensor([1, 3, 5]))
    assert built == []
    f(torch.arange(3))  # outside the trace it compiles as usual
    assert len(built) == 1
