"""The message format of a mirrored call, without processes: what the worker rebuilds equals
what rank 0 passed (tensors of mixed dtypes packed into one buffer, a tensor passed twice, KV
cache views by reference to the worker's own cache)."""
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


def test_a_call_survives_the_trip():
    base = resident.mark()
    caches = allocate_kv_caches(2, 32, 1, 4, torch.float32, torch.device("cpu"))
    ids = torch.tensor([3, 1, 4], dtype=torch.int64)
    feats = torch.randn(3, 5, dtype=torch.bfloat16)
    flags = torch.tensor([True, False])
    sampling = SamplingBatch.build([SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=0)],
                                   [11, 12], "cpu")
    items = [ForwardItem([1, 2], 0, [0, 1], 1)]
    call = ("drafter", "propose", (ids, feats, ids[1:], flags, caches, sampling, items), {"anchor_pos_host": [7]})
    message, packed = mirror.encode(call, base)
    assert len(packed) == 1  # every host tensor in one broadcast

    # the worker holds its own caches, allocated in the same order
    worker_caches = allocate_kv_caches(2, 32, 1, 4, torch.float32, torch.device("cpu"))
    worker_base = base + 1  # its allocations count from its own start: shift ours past rank 0's
    got = mirror.decode(message, _Loopback(packed, worker_base))
    name, method, args, kwargs = got
    assert (name, method, kwargs) == ("drafter", "propose", {"anchor_pos_host": [7]})
    g_ids, g_feats, g_tail, g_flags, g_caches, g_sampling, g_items = args
    assert torch.equal(g_ids, ids) and torch.equal(g_feats, feats) and torch.equal(g_tail, ids[1:])
    assert g_feats.dtype == torch.bfloat16 and torch.equal(g_flags, flags)
    assert g_caches[1][0].data_ptr() == worker_caches[1][0].data_ptr()  # the worker's cache, same view
    assert g_caches[1][0].shape == caches[1][0].shape
    assert torch.equal(g_sampling.temperature, sampling.temperature) and torch.equal(g_sampling.seeds, sampling.seeds)
    assert g_sampling.greedy == [False, True] and g_items == items
