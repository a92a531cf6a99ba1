"""Rank 0 announces a model call without waiting for the workers to receive it: a worker that
reads nothing yet (busy elsewhere) must not hold rank 0 back, for host tensors in the call too,
and for a message larger than a default pipe's 64 KiB; the worker then runs every call, in order,
with the same data. (The model's own collectives are what synchronizes the ranks.)"""
import fcntl
import json

import pytest
import torch

from adaspec.distributed.driver import launch
from adaspec.engine.runner import ForwardItem
from tests.distributed.tp_stub_worker import main as stub_main


def test_calls_do_not_wait_for_the_worker(tmp_path):
    go, reading, log = tmp_path / "go", tmp_path / "reading", tmp_path / "log"
    driver = launch(2, torch.device("cpu"), stub_main, (str(go), str(reading), str(log)))
    try:
        small = [ForwardItem([i], 512, list(range(33)), 1) for i in range(4)]
        sent = []
        for i in range(5):
            t = torch.arange(i, i + 3, dtype=torch.int64)
            driver.call("runner", "execute", lambda *a, **k: None, (small, t), {})
            sent.append([4, t.tolist()])
        if hasattr(fcntl, "F_SETPIPE_SZ"):  # Linux: the pipe was widened to hold a long-context batch
            big = [ForwardItem([7], 30000, list(range(2000, 4000)), 1) for _ in range(64)]
            driver.call("runner", "execute", lambda *a, **k: None, (big,), {})
            sent.append([64, None])
        # every call above returned while the worker read nothing (a rank 0 that waited for it,
        # e.g. in a gloo broadcast of the tensor or on a full pipe, returns only once it reads)
        assert not reading.exists()
        go.touch()
    finally:
        driver.shutdown()
    assert [p.exitcode for p in driver.procs.processes] == [0]
    assert json.loads(log.read_text()) == sent


@pytest.mark.skipif(not hasattr(fcntl, "F_SETPIPE_SZ"), reason="Linux pipes")
def test_the_big_message_exceeds_a_default_pipe():
    """The long-context batch above really needs the widened pipe (else the test proves nothing)."""
    from adaspec.distributed import mirror, resident

    big = [ForwardItem([7], 30000, list(range(2000, 4000)), 1) for _ in range(64)]
    message, _ = mirror.encode(("runner", "execute", (big,), {}), resident.mark())
    assert 64 * 1024 < len(message) < 1 << 20
