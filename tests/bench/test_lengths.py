"""--random-range-ratio (adaspec/bench/lengths.py): output lengths spread over [L(1 - r), L(1 + r)],
the same for every arm at a seed, sent as each request's max_tokens and recorded with the result."""
import math

import pytest
from hypothesis import given, settings, strategies as st

from adaspec.bench.lengths import check_range_ratio, output_lengths
from adaspec.bench.runner import BenchConfig, BenchError, run_benchmark
from .fakeclock import FakeClock
from .fakeserver import FakeServer, Script


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 300), length=st.integers(1, 4096), ratio=st.floats(0, 0.99), seed=st.integers(0, 2**32))
def test_lengths_stay_in_the_range(n, length, ratio, seed):
    got = output_lengths(n, length, ratio, seed)
    assert len(got) == n and all(isinstance(x, int) for x in got)
    low, high = max(1, math.floor(length * (1 - ratio))), max(1, math.ceil(length * (1 + ratio)))
    assert all(low <= x <= high for x in got)
    assert got == output_lengths(n, length, ratio, seed)  # the same for every arm


def test_zero_ratio_asks_for_the_length_itself():
    assert output_lengths(5, 64, 0.0, seed=3) == [64] * 5


def test_lengths_cover_the_range_uniformly():
    got = output_lengths(20_000, 64, 0.5, seed=0)
    assert min(got) == 32 and max(got) == 96
    # uniform over the 65 integers 32..96: each ~1/65 of the draws (binomial sd ~ 17 of ~308)
    counts = [got.count(v) for v in range(32, 97)]
    assert min(counts) > 308 - 6 * 17 and max(counts) < 308 + 6 * 17
    assert output_lengths(100, 64, 0.5, seed=1) != output_lengths(100, 64, 0.5, seed=2)


@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5, float("nan"), float("inf"), "0.5"])
def test_bad_ratio_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="--random-range-ratio must be in"):
        check_range_ratio(bad)


def test_requests_carry_the_spread_lengths_and_the_result_says_so():
    clock = FakeClock()
    prompts = [f"s:A{i}" for i in range(12)]
    scripts = {f"A{i}": Script(chunks=[(0.01, "a", 1)], prompt_tokens=2) for i in range(12)}
    with FakeServer(scripts, clock=clock) as srv:
        res = run_benchmark(BenchConfig(base_url=srv.url, model="m", prompts=prompts, max_concurrency=4,
                                        output_len=40, random_range_ratio=0.5, seed=7, num_warmups=2,
                                        progress=False, clock=clock))
        bodies = list(srv.requests)
    assert [b["max_tokens"] for b in bodies[:2]] == [40, 40]  # warm-ups ask for L
    sent = sorted((b["prompt"], b["max_tokens"]) for b in bodies[2:])
    assert sent == sorted(zip(prompts, output_lengths(12, 40, 0.5, seed=7)))
    assert len({m for _, m in sent}) > 1
    assert res["random_range_ratio"] == 0.5 and res["output_len"] == 40


def test_a_ratio_without_an_output_len_is_refused():
    cfg = BenchConfig(base_url="http://127.0.0.1:9", model="m", prompts=["p"], output_len=None,
                      random_range_ratio=0.5, progress=False)
    with pytest.raises(BenchError, match="random_range_ratio spreads output_len, which is not set"):
        run_benchmark(cfg)
