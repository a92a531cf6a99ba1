"""A worker rank for tests/distributed/test_tp_handshake.py: the real join and serve loop
(adaspec/distributed/worker.py) around a stub runner that logs the calls it receives. It reads
nothing until the file `go` exists (or FALLBACK_S have passed: a rank 0 that waits for it is then
released, and the test fails on the file `reading`, which it creates when it starts reading), and
writes its log to `log` when told to stop."""
import json
import os
import time

from adaspec.distributed import worker as w

FALLBACK_S = 30.0


class LoggingRunner:
    def __init__(self):
        self.calls = []

    def execute(self, items, tensor=None):
        self.calls.append([len(items), None if tensor is None else tensor.tolist()])


def main(index, go, reading, log, port, size, conns, parent_pid, beats):
    import torch

    wk, conn = w.join(index, port, size, conns, parent_pid, beats, torch.device("cpu"))
    deadline = time.monotonic() + FALLBACK_S
    while not os.path.exists(go) and time.monotonic() < deadline:  # rank 0's calls pile up in the pipe
        time.sleep(0.02)
    open(reading, "w").close()
    runner = LoggingRunner()
    wk.mirror("runner", runner)
    wk.serve(conn)
    with open(log, "w") as f:
        json.dump(runner.calls, f)
    w.leave()
