"""train/time_box.py: the drafter's wall-clock budget, on a fake clock."""
import pytest

from adaspec.train.time_box import StepTimeBox


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def run_box(box, clock, step_seconds, start=0):
    """Step the loop as train drafter does; step_seconds(step) is what that step costs."""
    step, total = start, box.max_steps
    while step < total:
        total = box.fit(step)
        clock.t += step_seconds(step)
        step += 1
    return step, clock.t


def test_steady_steps_fill_the_box():
    clock = FakeClock()
    box = StepTimeBox(150.0, 0, 4000, clock=clock)
    steps, spent = run_box(box, clock, lambda s: 0.04)
    assert steps == pytest.approx(150 / 0.04, abs=2) and spent == pytest.approx(150, abs=0.1)
    # after the first fit, on multiples of 100: where the loop has just read its logged loss back
    assert [f[0] for f in box.fits[:4]] == [40, 100, 200, 300]


def test_a_fast_probe_window_does_not_overrun_the_box():
    """H200 run 33: steps alternated 35 / 48 ms over blocks of 100 and the 30-step probe saw fast
    ones; one fit trained ~20% past the box. Refitting keeps it within a block of steps."""
    cost = lambda s: 0.035 if (s // 100) % 2 == 0 else 0.048  # noqa: E731
    clock = FakeClock()
    box = StepTimeBox(150.0, 0, 4000, clock=clock)
    steps, spent = run_box(box, clock, cost)
    assert spent == pytest.approx(150, abs=0.5), spent
    assert len(box.fits) > 10 and box.fits[0][:2] == (40, pytest.approx(0.035))
    # one fit only (the old box) would have trained its first total: 11% over
    first_total = box.fits[0][2]
    assert first_total == min(4000, 40 + int((150 - 40 * 0.035) / 0.035))
    assert sum(cost(s) for s in range(first_total)) > 1.1 * 150


def test_the_cap_binds_and_a_pessimistic_first_fit_recovers():
    clock = FakeClock()
    box = StepTimeBox(100.0, 0, 500, clock=clock)  # 500 steps of 10 ms fit easily
    assert run_box(box, clock, lambda s: 0.01)[0] == 500
    clock = FakeClock()
    box = StepTimeBox(100.0, 0, 10_000, clock=clock)
    cost = lambda s: 0.2 if s < 60 else 0.02  # noqa: E731  slow probe window, then fast
    steps, spent = run_box(box, clock, cost)
    assert box.fits[0][2] < 1000 and steps > 2 * box.fits[0][2] and spent == pytest.approx(100, abs=1.5)


def test_a_resumed_run_times_from_its_own_start_and_syncs_at_every_read():
    clock, synced = FakeClock(), []
    box = StepTimeBox(10.0, 300, 4000, clock=clock, sync=lambda: synced.append(clock.t))
    steps, spent = run_box(box, clock, lambda s: 0.01, start=300)
    assert steps - 300 == pytest.approx(1000, abs=2) and spent == pytest.approx(10, abs=0.02)
    assert [f[0] for f in box.fits[:3]] == [340, 400, 500] and len(synced) == 1 + len(box.fits)
    with pytest.raises(ValueError, match="positive budget"):
        StepTimeBox(0, 0, 10)
