"""offline_sweep's TTFT counts from when a closed-loop client would have sent the request (when a
slot freed), not from the start of the point: queued at t0, request j >= C waits for the
(j - C)-th request to finish before it gets a slot."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from offline_sweep import closed_loop_arrivals  # noqa: E402


def test_first_c_at_start_then_each_when_a_slot_frees():
    # C = 2, five requests; finishes listed out of order: 3.0, 1.0, 2.0, 5.0, 4.0
    got = closed_loop_arrivals(10.0, [3.0, 1.0, 2.0, 5.0, 4.0], 5, 2)
    assert got == [10.0, 10.0, 1.0, 2.0, 3.0]


def test_one_client_sends_each_request_when_the_previous_finished():
    assert closed_loop_arrivals(0.0, [0.5, 1.0, 1.5], 3, 1) == [0.0, 0.5, 1.0]
    assert closed_loop_arrivals(0.0, [0.5, 1.0], 2, 8) == [0.0, 0.0]  # C above n: all at once
