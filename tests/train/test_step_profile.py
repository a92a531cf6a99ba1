"""train/step_profile.py: the summary of a profiled training step, from fake profiler events and from
a real torch.profiler run on the CPU."""
import json
from types import SimpleNamespace

import torch

from adaspec.train.step_profile import StepProfile, format_summary, summarize

CUDA, CPU = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU


def _event(key, device_type, cpu_us=0.0, device_us=0.0, count=1):
    return SimpleNamespace(key=key, device_type=device_type, self_cpu_time_total=cpu_us,
                           self_device_time_total=device_us, count=count)


def test_on_the_device_only_kernels_count():
    events = [_event("aten::mm", CPU, cpu_us=50, device_us=900, count=4),  # the op: its kernel's time again
              _event("gemm_kernel", CUDA, device_us=900, count=4),
              _event("triton_fused_loss", CUDA, device_us=300, count=2),
              _event("idle", CUDA, device_us=0, count=1)]
    s = summarize(events, steps=2, wall_s=0.004, on_device=True)
    assert s["timer"] == "CUDA kernels" and s["wall_ms_per_step"] == 2.0 and s["timed_ms_per_step"] == 0.6
    assert [(r["name"], r["ms_per_step"], r["calls_per_step"], r["share"]) for r in s["top"]] == [
        ("gemm_kernel", 0.45, 2.0, 0.75), ("triton_fused_loss", 0.15, 1.0, 0.25)]


def test_on_the_cpu_every_op_counts_and_the_table_is_capped():
    events = [_event(f"op{i}", CPU, cpu_us=100 * (i + 1)) for i in range(20)]
    s = summarize(events, steps=1, wall_s=0.1, on_device=False, top=5)
    assert s["timer"] == "CPU ops" and [r["name"] for r in s["top"]] == ["op19", "op18", "op17", "op16", "op15"]
    assert s["timed_ms_per_step"] == 21.0
    assert format_summary({**s, "first_step": 3}).splitlines()[0].startswith("1 steps from step 3: 100.00 ms wall")


def test_a_real_profile_of_cpu_steps(tmp_path):
    w = torch.randn(64, 64, requires_grad=True)
    prof = StepProfile(steps=2, start=1, device=torch.device("cpu"), out_dir=tmp_path)
    for step in range(4):
        prof.maybe_start(step)
        (torch.randn(32, 64) @ w).square().mean().backward()
        if prof.maybe_stop(step + 1) is not None:
            assert step + 1 == 3
    s = json.loads((tmp_path / "step_profile.json").read_text())
    assert s == prof.summary and s["steps"] == 2 and s["first_step"] == 1
    assert any("mm" in r["name"] for r in s["top"]) and s["timed_ms_per_step"] > 0
    assert (tmp_path / "step_profile.txt").read_text().startswith("2 steps from step 1")


def test_no_profile_when_not_asked(tmp_path):
    prof = StepProfile(steps=0, start=0, device=torch.device("cpu"), out_dir=tmp_path)
    prof.maybe_start(0)
    assert prof.maybe_stop(0) is None and not (tmp_path / "step_profile.json").exists()


def test_a_profiler_that_fails_never_stops_the_loop(tmp_path, monkeypatch):
    def broken(*a, **kw):
        raise RuntimeError("CUPTI unavailable")

    monkeypatch.setattr(torch.profiler, "profile", broken)
    prof = StepProfile(steps=1, start=0, device=torch.device("cpu"), out_dir=tmp_path)
    for step in range(3):
        prof.maybe_start(step)
        assert prof.maybe_stop(step + 1) is None
    assert prof.summary == {"error": "RuntimeError: CUPTI unavailable", "first_step": 0}
    assert json.loads((tmp_path / "step_profile.json").read_text()) == prof.summary
    assert format_summary(prof.summary) == "step profile failed: RuntimeError: CUPTI unavailable"
