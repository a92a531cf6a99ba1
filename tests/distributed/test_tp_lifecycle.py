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


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_dead_worker_ends_the_engine_with_a_clear_error(sig):
    """SIGKILL: the worker dies, rank 0 raises and exits non-zero. SIGTERM is ignored by workers
    (rank 0 handles it and drains): the engine keeps running until we kill it."""
    script = Path(__file__).with_name("tp_victim.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line.startswith("workers"), proc.stderr.read()
        worker = int(line.split()[1])
        assert proc.stdout.readline().strip() == "step"  # it runs steps with the worker
        os.kill(worker, sig)
        if sig == signal.SIGTERM:
            assert proc.stdout.readline().strip() == "step"  # still serving after the signal
            os.kill(worker, signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode != 0
    assert "WorkerDiedError" in err and "tensor-parallel worker rank 1" in err and "SIGKILL" in err, err[-3000:]


@pytest.mark.slow
def test_a_hung_worker_ends_the_engine_with_a_clear_error():
    """SIGSTOP: the worker is alive but answers nothing; the collective times out
    (ADASPEC_TP_TIMEOUT_S) and rank 0 exits non-zero naming the cause."""
    script = Path(__file__).with_name("tp_victim.py")
    env = {**os.environ, "ADASPEC_TP_TIMEOUT_S": "15",
           "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    worker = None
    try:
        line = proc.stdout.readline()
        assert line.startswith("workers"), proc.stderr.read()
        worker = int(line.split()[1])
        assert proc.stdout.readline().strip() == "step"
        os.kill(worker, signal.SIGSTOP)
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        if worker is not None:
            try:
                os.kill(worker, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert proc.returncode != 0
    assert "WorkerDiedError" in err and "hung worker" in err, err[-3000:]
