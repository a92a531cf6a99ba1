"""The message format of a mirrored call, without processes: what the worker rebuilds equals
what rank 0 passed (tensors of mixed dtypes, inside the message or packed into one buffer for
a broadcast, a tensor passed twice, KV cache views by reference to the worker's own cache)."""
import pytest
import torch

from adaspec.distributed import mirror, resident
from adaspec.engine.kv_cache import allocate_kv_caches
from adaspec.engine.runner import ForwardItem
from adaspec.sample.batch import SamplingBatch
from adaspec.sampling_params import SamplingParams


class _Loopback:
    """A worker whose 'broadcast' is rank 0's packed buffer, handed over in order."""

    def __init__(self, packed, base):
        self.packed, self.resident_base = list(packed), base

    def receive_bytes(self, nbytes, kind):
        buf = self.packed.pop(0)
        assert buf.numel() == nbytes and buf.device.type == kind
        return buf.clone()


@pytest.mark.parametrize("inline_host", [True, False], ids=["host-tensors-in-message", "packed-broadcast"])
def test_a_call_survives_the_trip(inline_host):
    base = resident.mark()
    caches = allocate_kv_caches(2, 32, 1, 4, torch.float32, torch.device("cpu"))
    ids = torch.tensor([3, 1, 4], dtype=torch.int64)
    feats = torch.randn(3, 5, dtype=torch.bfloat16)
    flags = torch.tensor([True, False])
    sampling = SamplingBatch.build([SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=0)],
                                   [11, 12], "cpu")
    items = [ForwardItem([1, 2], 0, [0, 1], 1)]
    call = ("drafter", "propose", (ids, feats, ids[1:], flags, caches, sampling, items), {"anchor_pos_host": [7]})
    message, packed = mirror.encode(call, base, inline_host=inline_host)
    # host tensors ride in the message (no collective for rank 0 to wait on); packed (as device
    # tensors are), every one of them shares one broadcast
    assert len(packed) == (0 if inline_host else 1)

    # the worker holds its own caches, allocated in the same order
    worker_caches = allocate_kv_caches(2, 32, 1, 4, torch.float32, torch.device("cpu"))
    worker_base = base + 1  # its allocations count from its own start: shift ours past rank 0's
    got = mirror.decode(message, _Loopback(packed, worker_base))
    name, method, args, kwargs = got
    assert (name, method, kwargs) == ("drafter", "propose", {"anchor_pos_host": [7]})
    g_ids, g_feats, g_tail, g_flags, g_caches, g_sampling, g_items = args
    assert torch.equal(g_ids, ids) and torch.equal(g_feats, feats) and torch.equal(g_tail, ids[1:])
    assert g_ids.shape == ids.shape and g_tail.shape == (2,)
    assert g_feats.dtype == torch.bfloat16 and torch.equal(g_flags, flags)
    assert g_caches[1][0].data_ptr() == worker_caches[1][0].data_ptr()  # the worker's cache, same view
    assert g_caches[1][0].shape == caches[1][0].shape
    assert torch.equal(g_sampling.temperature, sampling.temperature) and torch.equal(g_sampling.seeds, sampling.seeds)
    assert g_sampling.greedy == [False, True] and g_items == items


def test_block_tables_pickle_without_a_per_object_callback():
    """A decode batch's ints and lists must not go through Python code while pickling (a
    persistent_id hook sees every one of them: 0.37 ms per call at 64 requests of 512 tokens,
    benchmarks/tp_handshake_bench.py): count the Python calls made during encode."""
    import sys

    items = [ForwardItem([7], 512, list(range(33)), 1) for _ in range(64)]
    calls = []
    sys.setprofile(lambda frame, event, arg: calls.append(1) if event == "call" else None)
    try:
        mirror.encode(("runner", "execute", (items,), {}), resident.mark())
    finally:
        sys.setprofile(None)
    assert len(calls) < 4 * len(items), len(calls)  # a few per ForwardItem, none per block id


def test_empty_and_scalar_host_tensors():
    empty, scalar = torch.zeros(0, 3, dtype=torch.int64), torch.tensor(2.5, dtype=torch.bfloat16)
    message, packed = mirror.encode(("runner", "execute", (empty, scalar), {}), resident.mark())
    got = mirror.decode(message, _Loopback(packed, resident.mark()))[2]
    assert got[0].shape == (0, 3) and got[0].dtype == torch.int64
    assert got[1].shape == () and got[1].dtype == torch.bfloat16 and got[1].item() == 2.5
