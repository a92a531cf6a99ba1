"""How rank 0 tells the workers which model call to run.

A call is (object name, method name, args, kwargs), pickled; tensors are reduced specially
(`reducer_override`, which the C pickler consults only for objects that are not ints, strings,
lists, dicts or tuples, so block tables and token lists pickle at C speed):
- a KV cache view (resident.py) becomes a reference; the worker substitutes its own cache;
- a host tensor travels inside the message, as its bytes: no collective, so rank 0 does not
  wait for the worker to receive it (tests/distributed and benchmarks/tp_handshake_bench.py);
- a device tensor (CUDA under NCCL) becomes a placeholder (its index); the device tensors of
  one call travel packed in one broadcast on the device group (enqueued on the stream: rank 0's
  host goes on), their bytes laid end to end at 16-byte aligned offsets;
- everything else (ForwardItem lists, SamplingBatch flags, host ints) is pickled as is.
The message (the packed tensors' shapes and dtypes, then the pickled call) goes over a
multiprocessing pipe per worker, before the broadcast; send order = call order.

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


def _ref(*ref):
    """What a KV cache view or a packed device tensor pickles as; only decode's unpickler resolves it."""
    raise RuntimeError("a mirrored call's tensor reference can only be loaded by mirror.decode")


def _host_tensor(data: bytes, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


class _Pickler(pickle.Pickler):
    def __init__(self, buf, base: int, inline_host: bool):
        super().__init__(buf, protocol=pickle.HIGHEST_PROTOCOL)
        self.base, self.inline_host, self.tensors = base, inline_host, []

    def reducer_override(self, obj):
        if not isinstance(obj, torch.Tensor):
            return NotImplemented
        ref = resident.lookup(obj, self.base)
        if ref is not None:
            return _ref, ("kv", *ref)
        t = obj.detach().contiguous()
        if self.inline_host and t.device.type == "cpu":
            return _host_tensor, (t.reshape(-1).view(torch.uint8).numpy().tobytes(), t.dtype, tuple(t.shape))
        self.tensors.append(t)  # the pickler's memo sends a tensor passed twice once
        return _ref, ("t", len(self.tensors) - 1)


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, tensors: list[torch.Tensor], base: int):
        super().__init__(io.BytesIO(data))
        self.tensors, self.base = tensors, base

    def find_class(self, module, name):
        if module == __name__ and name == "_ref":
            return self._resolve
        return super().find_class(module, name)

    def _resolve(self, kind, *ref):
        if kind == "kv":
            return resident.resolve(*ref, base=self.base)
        return self.tensors[ref[0]]


_ALIGN = 16


def _layout(metas) -> dict[str, tuple[int, list[int]]]:
    """device kind -> (packed bytes, byte offset of each tensor of that kind, in call order)."""
    out: dict[str, tuple[int, list[int]]] = {}
    for shape, dtype, kind in metas:
        total, offsets = out.get(kind, (0, []))
        offsets.append(total)
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        out[kind] = (total + -(-nbytes // _ALIGN) * _ALIGN, offsets)
    return out


def encode(call, base: int, inline_host: bool = True) -> tuple[bytes, list[torch.Tensor]]:
    """-> (the message, the packed buffers to broadcast after it, one per device kind in sorted
    order: none when every tensor is a host tensor or a KV cache view). inline_host=False packs
    host tensors too (tests/distributed/test_mirror.py exercises the packing on CPU that way)."""
    buf = io.BytesIO()
    p = _Pickler(buf, base, inline_host)
    p.dump(call)
    metas = [(tuple(t.shape), t.dtype, t.device.type) for t in p.tensors]
    packed = []
    for kind, (total, offsets) in sorted(_layout(metas).items()):
        ts = [t for t in p.tensors if t.device.type == kind]
        out = torch.empty(total, dtype=torch.uint8, device=ts[0].device)
        for t, off in zip(ts, offsets):
            out[off:off + t.numel() * t.element_size()].copy_(t.reshape(-1).view(torch.uint8))
        packed.append(out)
    return pickle.dumps((metas, buf.getvalue()), protocol=pickle.HIGHEST_PROTOCOL), packed


def decode(message: bytes, ctx):
    """The worker's side: receive the packed tensors (if any), then rebuild the call around them."""
    metas, data = pickle.loads(message)
    tensors: list[torch.Tensor | None] = [None] * len(metas)
    for kind, (total, offsets) in sorted(_layout(metas).items()):
        buf = ctx.receive_bytes(total, kind)
        idx = [i for i, m in enumerate(metas) if m[2] == kind]
        for i, off in zip(idx, offsets):
            shape, dtype, _ = metas[i]
            n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            tensors[i] = buf[off:off + n].view(dtype).view(shape)
    return _Unpickler(data, tensors, ctx.resident_base).load()


def broadcast_packed(buf: torch.Tensor, ctx) -> None:
    if buf.numel():
        dist.broadcast(buf, src=0, group=ctx.group_for(buf.device.type))


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
