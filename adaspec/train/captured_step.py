"""The drafter's training step replayed as one CUDA graph (`adaspec train drafter --cuda-graph-step`).

Why: with the target's features cached and the drafter's pass and loss compiled, the step's
kernels are ~25 ms and the host launching them is slower: H100 run 51's build made 4,000 steps at
~30 ms of wall time each for 25.5 ms of CUDA kernels (its step profile, build.log), so the
drafter stage waited ~20 s on Python. A replay launches the whole step at once: the batch's
features, the drafter's forward, the loss, the backward, the gradient clipping and AdamW.

What stays on the host, between replays: drawing the batch (rows, windows, anchors), copying
it into the graph's static inputs (pinned, asynchronous), the learning rate (a device tensor
AdamW reads: `capturable=True`), reading the loss and statistics back every --log-every steps,
the held-out measurements and the time box.

Capture rules this relies on (PyTorch's "whole network capture"):
- the step has run normally first (WARM_STEPS), so AdamW's state exists, the compiled
  functions are compiled for these shapes, and libraries have their workspaces;
- gradients are None when the capture starts: autograd then allocates them inside the graph's
  memory pool and every replay writes them afresh (it assigns a None .grad, never accumulates),
  so nothing zeroes them while the graph lives;
- no host read inside the step (a sync fails the capture), and autocast without its weight cache;
- one stream for the ordinary steps and the capture, and no autograd graph of an earlier step kept
  alive (the step returns its loss detached): a parameter's AccumulateGrad node made on another
  stream makes the capture's backward wait on that stream, which invalidates the capture.
A capture that fails leaves training as it was: the step runs as before, with a warning.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import torch

from adaspec.engine.graph_capture import record_graph

# ordinary steps before the step is captured: the first compiles, AdamW's state appears at the first
# opt.step(), and the capture must see every kernel's workspace already allocated
WARM_STEPS = 3


class CapturedStep:
    """fn(**inputs) -> outputs, as one graph over static copies of `inputs` (device tensors of
    fixed shape). eager=True replays by calling fn on the static inputs with the gradients set to
    None first (the graph's semantics; CPU tests of the loop)."""

    def __init__(self, fn: Callable, inputs: dict[str, torch.Tensor], zero_grad: Callable[[], None],
                 eager: bool = False):
        self.fn, self.zero_grad, self.eager = fn, zero_grad, eager
        self.inputs = {k: v.clone() for k, v in inputs.items()}
        self.graph = None
        self.outputs = None

    def load(self, **inputs: torch.Tensor) -> None:
        """Copy this step's inputs into the static buffers (same shapes, on the stream's order)."""
        for k, v in inputs.items():
            self.inputs[k].copy_(v, non_blocking=True)

    def capture(self) -> None:
        """Record the step (nothing runs: replay() then performs it). Raises what the capture raised."""
        if self.eager:
            return
        self.zero_grad()
        torch.cuda.synchronize()
        # recorded on the stream the ordinary steps ran on (the caller's side stream), not the
        # graph API's own: what autograd made in those steps is on this stream (drafter.py)
        graph, outputs = record_graph(lambda: self.fn(**self.inputs), stream=torch.cuda.current_stream())
        self.graph, self.outputs = graph, outputs

    def replay(self):
        if self.eager:
            self.zero_grad()
            return self.fn(**self.inputs)
        self.graph.replay()
        return self.outputs

    def release(self) -> None:
        if self.graph is not None:
            self.graph.reset()
        self.graph = self.outputs = None


def capture_step(fn: Callable, inputs: dict[str, torch.Tensor], opt, eager: bool = False):
    """The CapturedStep of fn on inputs' shapes (opt: the optimizer whose gradients it resets), or
    False (with a warning) where the capture failed: training goes on with ordinary steps."""
    from tqdm import tqdm

    captured = CapturedStep(fn, inputs, lambda: opt.zero_grad(set_to_none=True), eager=eager)
    t0 = time.time()
    try:
        captured.capture()
    except Exception as e:  # noqa: BLE001 - an optimization: never lose the run to it
        captured.release()
        opt.zero_grad(set_to_none=True)
        if not eager:
            torch.cuda.synchronize()
        tqdm.write(f"WARNING: capturing the training step as a CUDA graph failed ({type(e).__name__}: "
                   f"{str(e)[:300]}); training with ordinary steps (with the flag's settings: a capturable AdamW, "
                   "autocast without its weight cache, a side stream; without --cuda-graph-step they would not apply)")
        return False
    tqdm.write(f"the training step runs as one CUDA graph from here (captured in {time.time() - t0:.1f} s)")
    return captured
