"""Worker processes: a clean stop at shutdown, a clear error and a non-zero exit when one dies,
one tensor-parallel engine per process."""
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from adaspec import LLM
from adaspec.errors import ConfigError

KW = dict(device="cpu", num_kv_blocks=64, max_model_len=256, max_num_seqs=2)


def test_workers_stop_on_shutdown():
    llm = LLM("tiny", tensor_parallel_size=2, **KW)
    procs = llm.llm_engine.tp.procs.processes
    assert all(p.is_alive() for p in procs)
    with pytest.raises(ConfigError, match="already belongs to a torch.distributed group"):
        LLM("tiny", tensor_parallel_size=2, **KW)
    llm.llm_engine.shutdown()
    assert all(p.exitcode == 0 for p in procs)  # they were told to stop: a clean exit, not a kill
    LLM("tiny", tensor_parallel_size=2, **KW).llm_engine.shutdown()  # the process can start another


def test_shutdown_frees_the_cuda_graphs_before_leaving_the_group(monkeypatch):
    """A live CUDA graph holding NCCL collectives makes destroy_process_group hang: rank 0 frees
    its graphs first (the workers do the same before they leave)."""
    from adaspec.distributed import driver as driver_module

    order = []

    class Graphs:  # stands in for GraphedForward (CPU engines capture none)
        def release(self):
            order.append("release")
            return 3

    real_leave = driver_module.leave_group
    monkeypatch.setattr(driver_module, "leave_group", lambda: order.append("leave") or real_leave())
    llm = LLM("tiny", tensor_parallel_size=2, **KW)
    llm.llm_engine.runner.graphs = Graphs()
    llm.llm_engine.shutdown()
    assert order == ["release", "leave"]
    assert llm.llm_engine.runner.graphs is None


def _victim(*args, **env):
    script = Path(__file__).with_name("tp_victim.py")
    env = {**os.environ, **env,
           "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, str(script), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    line = proc.stdout.readline()
    if not line.startswith("workers"):
        proc.kill()
        pytest.fail(proc.communicate()[1][-3000:])
    return proc, int(line.split()[1])


def _kill(pid):
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _finish(proc, worker=None):
    """-> stderr once proc exits (killed after 120 s, and the worker with it: the test then fails
    on its exit status; a live worker would hold the output pipes open)."""
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        if worker is not None:
            _kill(worker)
        proc.kill()
        err = proc.communicate()[1] + "\n(test: killed after 120 s)"
    if worker is not None:
        _kill(worker)
    return err


def test_a_dead_worker_ends_the_engine_with_a_clear_error():
    """SIGTERM is ignored by workers (rank 0 handles it and drains): the engine keeps running.
    SIGKILL: the worker dies, rank 0 raises and exits non-zero naming it (a worker that had died
    of the SIGTERM would be named with that signal). One engine for both signals: its start-up is
    most of the test's time."""
    proc, worker = _victim()
    assert proc.stdout.readline().strip() == "step"  # it runs steps with the worker
    os.kill(worker, signal.SIGTERM)
    assert proc.stdout.readline().strip() == "step"  # still serving after the signal
    os.kill(worker, signal.SIGKILL)
    err = _finish(proc, worker)
    assert proc.returncode != 0
    assert "WorkerDiedError" in err and "tensor-parallel worker rank 1" in err and "SIGKILL" in err, err[-3000:]


@pytest.mark.slow
def test_a_worker_dying_while_the_engine_is_idle_ends_the_process():
    """No step runs to raise the error: the monitor logs it and the process exits with status 1."""
    proc, worker = _victim("idle")
    assert proc.stdout.readline().strip() == "step"
    os.kill(worker, signal.SIGKILL)
    err = _finish(proc, worker)
    assert proc.returncode == 1
    assert "tensor-parallel worker rank 1" in err and "exiting with status 1" in err, err[-3000:]


@pytest.mark.slow
def test_a_hung_worker_ends_the_engine_with_a_clear_error():
    """SIGSTOP: the worker is alive but frozen; its heartbeat stops (ADASPEC_TP_HEARTBEAT_S), rank 0
    kills the workers and exits non-zero naming the cause."""
    proc, worker = _victim(ADASPEC_TP_HEARTBEAT_S="4")
    assert proc.stdout.readline().strip() == "step"
    os.kill(worker, signal.SIGSTOP)
    err = _finish(proc, worker)
    assert proc.returncode != 0
    assert "WorkerDiedError" in err and "given no sign of life" in err, err[-3000:]


@pytest.mark.slow
def test_a_collective_timeout_ends_the_engine_with_a_clear_error():
    """The fallback when the heartbeat goes on (e.g. a worker stuck in a device call): the
    collective's own timeout (ADASPEC_TP_TIMEOUT_S) ends the engine, naming the cause."""
    proc, worker = _victim(ADASPEC_TP_TIMEOUT_S="15", ADASPEC_TP_HEARTBEAT_S="1000")
    assert proc.stdout.readline().strip() == "step"
    os.kill(worker, signal.SIGSTOP)
    err = _finish(proc, worker)
    assert proc.returncode != 0
    assert "WorkerDiedError" in err and "hung worker" in err, err[-3000:]


def test_a_script_without_the_main_guard_fails_fast_and_says_why(tmp_path):
    """Spawned workers import the script's main module; unguarded, they die before joining the
    group. Rank 0 must say so at once, not wait out the group's timeout."""
    script = tmp_path / "unguarded.py"
    script.write_text('from adaspec import LLM\nLLM("tiny", device="cpu", tensor_parallel_size=2, num_kv_blocks=64, '
                      'max_model_len=256)\nprint("built")\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode != 0 and "built" not in out.stdout
    assert "WorkerDiedError" in out.stderr and 'if __name__ == "__main__":' in out.stderr, out.stderr[-3000:]
