"""Recording one CUDA graph with Python's cyclic garbage collector paused.

Why: a collection that runs while a stream captures finalizes whatever garbage it finds, and
garbage can hold CUDA graphs: an engine dropped earlier (a test's, a benchmark arm's) lives on in
its reference cycles until a collection frees it. A graph's destructor then calls
cudaGraphExecDestroy, which is not permitted during a capture, and the capture is invalidated
(cudaErrorStreamCaptureInvalidated): the engine being built fails to start. torch.cuda.graph
collected at its entry in older releases; 2.13's collects only with
torch.compiler.config.force_cudagraph_gc, and no collection at the entry keeps one from starting
inside the capture, where our code allocates Python objects.

H100 run 61 saw such a failure. In one test process, the fixed-k engine's second build (right after
the adaptive engine's first) had its first verify-graph capture invalidated, where its first and
later builds captured; and the process printed 84 "operation not permitted when stream is capturing
(function reset)" warnings within 3 ms, which is what graphs destroyed during a capture print
(BENCHMARKS.md).

Pausing costs nothing (no collection is forced): garbage made meanwhile is collected at the next
automatic collection after the capture, outside it.
"""
from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch


@contextmanager
def collector_paused() -> Iterator[None]:
    """gc off for the block; back on after (errors included) if it was on before."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def record_graph(fn: Callable[[], Any], pool=None, stream: torch.cuda.Stream | None = None
                 ) -> tuple[torch.cuda.CUDAGraph, Any]:
    """(the graph, fn's outputs): fn() captured into a new CUDA graph (torch.cuda.graph's pool and
    stream), with the collector paused from before the capture begins until after it ends."""
    graph = torch.cuda.CUDAGraph()
    with collector_paused(), torch.cuda.graph(graph, pool=pool, stream=stream):
        outputs = fn()
    return graph, outputs
