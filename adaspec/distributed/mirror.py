"""How rank 0 tells the workers which model call to run.

A call is (object name, method name, args, kwargs), pickled with persistent ids:
- a KV cache view (resident.py) becomes a reference; the worker substitutes its own cache;
- any other tensor becomes a placeholder (shape, dtype, device kind) and travels by
  torch.distributed.broadcast after the message, in the order the pickler met them (each
  tensor once); the worker's unpickler receives them in that same order;
- everything else (ForwardItem lists, SamplingBatch flags, host ints) is pickled as is.
The message itself goes over a multiprocessing pipe per worker (send order = call order).

`Mirror` is the proxy rank 0's engine calls instead of the object: the named methods are
announced then run locally; every other attribute is the object's own."""
from __future__ import annotations

import io
import pickle

import torch
import torch.distributed as dist

from adaspec.distributed import resident

# The methods whose work runs collectives, per mirrored object; everything else stays local.
# Rule for new code: every call that runs the sharded model (a new graphed propose, a new
# runner entry point) must be such a method of an object the engine passes through
# `tp.mirror(name, obj)` on every rank; a call made on rank 0 alone would leave its
# collectives waiting for the workers (gloo: ADASPEC_TP_TIMEOUT_S; NCCL: for ever).
MIRRORED_METHODS = {
    "runner": ("execute",),
    "drafter": ("propose", "write_context", "backbone_step"),
}


class _Pickler(pickle.Pickler):
    def __init__(self, buf, base: int):
        super().__init__(buf, protocol=pickle.HIGHEST_PROTOCOL)
        self.base, self.tensors, self.seen = base, [], {}

    def persistent_id(self, obj):
        if not isinstance(obj, torch.Tensor):
            return None
        ref = resident.lookup(obj, self.base)
        if ref is not None:
            return ("kv", *ref)
        key = id(obj)
        if key not in self.seen:
            self.seen[key] = len(self.tensors)
            self.tensors.append(obj.detach().contiguous())
        t = self.tensors[self.seen[key]]
        return ("t", self.seen[key], tuple(t.shape), t.dtype, t.device.type)


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, ctx):
        super().__init__(io.BytesIO(data))
        self.ctx, self.tensors = ctx, {}

    def persistent_load(self, pid):
        if pid[0] == "kv":
            return resident.resolve(*pid[1:], base=self.ctx.resident_base)
        _, n, shape, dtype, kind = pid
        if n not in self.tensors:  # first occurrence: it is the next broadcast
            self.tensors[n] = self.ctx.receive_tensor(shape, dtype, kind)
        return self.tensors[n]


def encode(call, base: int) -> tuple[bytes, list[torch.Tensor]]:
    buf = io.BytesIO()
    p = _Pickler(buf, base)
    p.dump(call)
    return buf.getvalue(), p.tensors


def decode(data: bytes, ctx):
    return _Unpickler(data, ctx).load()


def broadcast_tensor(t: torch.Tensor, ctx) -> None:
    if t.numel():
        dist.broadcast(t, src=0, group=ctx.group_for(t.device.type))


class Mirror:
    """Rank 0's stand-in for a model-facing object (the runner, the drafter)."""

    def __init__(self, name: str, obj, driver):
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_obj", obj)
        object.__setattr__(self, "_driver", driver)

    def __getattr__(self, attr):
        value = getattr(self._obj, attr)
        if attr in MIRRORED_METHODS.get(self._name, ()):
            name, driver = self._name, self._driver

            def mirrored(*args, **kwargs):
                return driver.call(name, attr, value, args, kwargs)

            return mirrored
        return value

    def __setattr__(self, attr, value):  # e.g. runner.graphs = ...
        setattr(self._obj, attr, value)

    def __call__(self, *args, **kwargs):
        raise TypeError(f"call the mirrored {self._name}'s methods, not the object")

    @property
    def unwrapped(self):
        return self._obj
