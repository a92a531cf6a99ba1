"""adaspec/h2d.py's batched uploads: what comes out on the device is what went in, piece by piece."""
import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from adaspec.h2d import to_device_arrays, to_device_many

DTYPES = [torch.int64, torch.int32, torch.bool, torch.float32]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 5), min_size=0, max_size=3)),
                max_size=6), st.integers(0, 2**31 - 1))
def test_arrays_come_back_with_their_shapes_dtypes_and_values(specs, seed):
    rng = np.random.default_rng(seed)
    arrays = []
    for dtype, shape in specs:
        if dtype == torch.bool:
            a = rng.random(shape) < 0.5
        elif dtype == torch.float32:
            a = rng.standard_normal(shape).astype(np.float32)
        else:  # values that need every byte of the type
            info = np.iinfo(np.int64 if dtype == torch.int64 else np.int32)
            a = rng.integers(info.min, info.max, size=shape, dtype=np.int64 if dtype == torch.int64 else np.int32)
        arrays.append((a, dtype))
    got = to_device_arrays(arrays, "cpu")
    assert len(got) == len(arrays)
    for t, (a, dtype) in zip(got, arrays):
        assert t.dtype == dtype and tuple(t.shape) == tuple(np.shape(a))
        assert np.array_equal(t.numpy(), a)


def test_lists_and_odd_sizes_keep_their_neighbours_apart():
    a, b, c = to_device_arrays([([1, 2, 3], torch.int32), ([True], torch.bool), ([[7], [8]], torch.int64)], "cpu")
    assert a.tolist() == [1, 2, 3] and b.tolist() == [True] and c.tolist() == [[7], [8]]


def test_to_device_many_splits_as_given():
    a, b, c = to_device_many([[1, 2], [], [3]], "cpu")
    assert a.tolist() == [1, 2] and b.tolist() == [] and c.tolist() == [3] and a.dtype == torch.int64
    (f,) = to_device_many([[1e300, 0.5]], "cpu", torch.float32)
    assert f.dtype == torch.float32 and f.tolist() == [float("inf"), 0.5]
