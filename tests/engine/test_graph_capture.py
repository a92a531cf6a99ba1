"""Every CUDA graph capture runs with the cyclic garbage collector paused (engine/graph_capture.py):
a collection inside a capture can destroy an earlier engine's graphs, which invalidates the capture."""
import gc
import weakref
from pathlib import Path

import pytest
import torch

import adaspec
from adaspec.engine import graph_capture
from adaspec.engine.graph_capture import collector_paused, record_graph


@pytest.fixture
def collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


class _Cycle:
    def __init__(self):
        self.me = self


def _garbage_cycle_flag() -> list[bool]:
    """A reference cycle dropped at once, so only a collection frees it; the flag says when it did."""
    freed = [False]
    weakref.finalize(_Cycle(), freed.__setitem__, 0, True)
    return freed


def _churn() -> None:
    """Allocate far more container objects than the youngest generation's threshold, which starts
    an automatic collection when the collector is on."""
    keep = [[i] for i in range(50 * gc.get_threshold()[0])]
    del keep


def test_an_automatic_collection_frees_a_cycle_when_the_collector_is_on(collector_on):
    freed = _garbage_cycle_flag()
    _churn()
    assert freed[0]  # the premise of the next test: churn alone collects


def test_no_automatic_collection_runs_while_paused(collector_on):
    with collector_paused():
        assert not gc.isenabled()
        freed = _garbage_cycle_flag()
        _churn()
        assert not freed[0]
    assert gc.isenabled()
    gc.collect()
    assert freed[0]


def test_the_pause_restores_the_collector_after_an_error(collector_on):
    with pytest.raises(ValueError):
        with collector_paused():
            raise ValueError("inside")
    assert gc.isenabled()


def test_the_pause_leaves_a_disabled_collector_disabled(collector_on):
    gc.disable()
    with collector_paused():
        pass
    assert not gc.isenabled()


def test_record_graph_captures_with_the_collector_paused(monkeypatch, collector_on):
    seen = []

    class FakeGraph:
        pass

    class FakeCapture:
        def __init__(self, graph, pool=None, stream=None):
            seen.append(("args", graph, pool, stream))

        def __enter__(self):
            seen.append(("begin", gc.isenabled()))

        def __exit__(self, *exc):
            seen.append(("end", gc.isenabled()))
            return False

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", FakeCapture)
    graph, out = record_graph(lambda: (seen.append(("fn", gc.isenabled())), 7)[1], pool="pool", stream="s")
    assert isinstance(graph, FakeGraph) and out == 7
    assert seen == [("args", graph, "pool", "s"), ("begin", False), ("fn", False), ("end", False)]
    assert gc.isenabled()


def test_every_capture_in_the_package_and_its_benchmarks_goes_through_record_graph():
    """A raw torch.cuda.graph(...) or capture_begin elsewhere would capture with the collector running."""
    root = Path(adaspec.__file__).parent
    own = Path(graph_capture.__file__).resolve()
    files = list(root.rglob("*.py")) + list((root.parent / "benchmarks").rglob("*.py"))
    raw = [str(p) for p in files
           if p.resolve() != own and any(s in p.read_text() for s in ("torch.cuda.graph(", "capture_begin("))]
    assert raw == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_garbage_holding_a_graph_cannot_invalidate_a_capture(collector_on):
    """The failure itself, on purpose: an earlier graph left in a garbage cycle, then a capture
    whose function allocates enough to start an automatic collection. Unpaused, that collection
    destroys the old graph inside the capture, which invalidates it."""
    x = torch.zeros(4, device="cuda")
    for _ in range(2):  # warm-up: the kernels load outside any capture
        x.add_(1)
        x * 2
    torch.cuda.synchronize()
    gc.collect()
    old, _ = record_graph(lambda: x.add_(1))
    holder = _Cycle()
    holder.graph = old
    freed = [False]
    weakref.finalize(holder, freed.__setitem__, 0, True)
    del old, holder

    def fn():
        _churn()
        return x * 2

    graph, out = record_graph(fn)
    assert not freed[0]  # the old graph lived through the capture
    x.fill_(3)
    graph.replay()
    torch.cuda.synchronize()
    assert out.tolist() == [6.0] * 4
    gc.collect()
    assert freed[0]
