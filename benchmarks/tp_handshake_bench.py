"""What one mirrored model call costs on the host (issue 14): rank 0 announcing a call to a
tensor-parallel worker, with the model forward replaced by the one thing that ties the ranks
together inside it, a 1-element all-reduce (the first collective of the forward). CPU, gloo,
2 ranks; the real launch (driver.launch), announcement (Driver.call) and worker loop
(Worker.serve), only the mirrored objects are stubs.

Per payload (a decode batch's runner.execute at batch 1 and 64, block tables of a 512-token
context; a drafter.propose-like call carrying host tensors at batch 1 and 64) it reports, as
medians over --iters calls, on one monotonic clock for both processes, from the call's start:
- rank 0: encode (pickling, packing tensors), send (the pipe write), then until rank 0 enters its
  own part (`blocked`: the broadcast of packed tensors, if any, and Python);
- worker: pipe (from rank 0's write until the worker's read returns: wake-up included), decode
  (unpickling, and receiving the broadcast, if any), dispatch (until the stub is entered), and
  `lag`, the sum: how late the worker reaches the forward's first collective;
- call: rank 0's whole call with the stub forward, minus one all-reduce between ranks that are
  both waiting (measured apart, 10 back-to-back all-reduces in one call);
- and, in one process without the pipe, encode and decode alone, and the message size.
The phases are timed by wrapping mirror.encode / mirror.decode as driver.py and worker.py call
them and the pipe's ends; nothing else of the library is changed.
With --gap-ms G, rank 0 busy-waits G ms before each call (its own work between model calls:
scheduling, sampling), so that the worker is back waiting for the next message, as in the engine
on a GPU where its forward's kernels run asynchronously. By default (0) calls go back to back: the
steadiest figures on a shared machine, but the worker's lag then also holds its return from the
previous call's collective.
Usage: python3 benchmarks/tp_handshake_bench.py [--iters 300]  (writes $OUT/tp_handshake_bench.json)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

BLOCK, CONTEXT = 16, 512
MARKS: dict[str, list[float]] = {"encoded": [], "sent": [], "recv": [], "decoded": []}  # this process's


def _after(fn, mark):
    def timed(*a, **kw):
        out = fn(*a, **kw)
        MARKS[mark].append(time.perf_counter())
        return out

    return timed


class TimedConn:
    """A pipe end that notes when a send or a receive returned."""

    def __init__(self, conn):
        self.conn = conn
        self.send_bytes = _after(conn.send_bytes, "sent")
        self.recv_bytes = _after(conn.recv_bytes, "recv")

    def __getattr__(self, name):
        return getattr(self.conn, name)


class Stub:
    """Stands in for the runner and the drafter on every rank: records when a call enters it
    and runs one all-reduce where the model's forward would run its first."""

    def __init__(self):
        self.one = torch.zeros(1)
        self.entered: list[float] = []

    def execute(self, items, capture_layers=None):
        self.entered.append(time.perf_counter())
        dist.all_reduce(self.one)

    def propose(self, *args, **kwargs):
        self.entered.append(time.perf_counter())
        dist.all_reduce(self.one)

    def sync(self, n: int):
        for _ in range(n):
            dist.all_reduce(self.one)

    def report(self, n: int) -> list[list[float]]:
        """The worker's times of its last n calls (read, decoded, entered) to rank 0 (a broadcast
        from rank 1); this report call's own read and decode are the last marks."""
        if dist.get_rank() == 1:
            rows = [MARKS["recv"][-n - 1:-1], MARKS["decoded"][-n - 1:-1], self.entered[-n:]]
        else:
            rows = [[0.0] * n] * 3
        t = torch.tensor(rows, dtype=torch.float64)
        dist.broadcast(t, src=1)
        self.entered.clear()
        for v in MARKS.values():
            v.clear()
        return t.tolist()


def bench_worker(index, port, size, conns, parent_pid, beats):
    from adaspec.distributed import worker as w

    wk, conn = w.join(index, port, size, conns, parent_pid, beats, torch.device("cpu"))
    w.decode = _after(w.decode, "decoded")
    conn = TimedConn(conn)
    stub = Stub()
    wk.mirror("runner", stub)
    wk.mirror("drafter", stub)
    wk.serve(conn)
    w.leave()


def payloads():
    import random

    from adaspec.engine.runner import ForwardItem
    from adaspec.sample.batch import SamplingBatch
    from adaspec.sampling_params import SamplingParams

    rng = random.Random(0)
    out = {}
    for b in (1, 64):
        n_blocks = -(-(CONTEXT + 1) // BLOCK)
        tables = [[rng.randrange(4096) for _ in range(n_blocks)] for _ in range(b)]
        items = [ForwardItem([rng.randrange(150000)], CONTEXT, t, 1) for t in tables]
        out[f"execute b={b}"] = ("runner", "execute", (items,), {})
        sampling = SamplingBatch.build([SamplingParams(temperature=0)] * b, list(range(b)), "cpu")
        ids = torch.randint(0, 150000, (b,))
        pos = torch.full((b,), CONTEXT, dtype=torch.int64)
        out[f"propose b={b}"] = ("drafter", "propose", (ids, pos, tables, BLOCK, None, sampling),
                                 {"anchor_pos_host": [CONTEXT] * b})
    return out


def _med_us(xs):
    return round(1e6 * statistics.median(xs), 1)


def time_codec(call, base, iters):
    """encode and decode in this process; -> (encode s, decode s, message bytes, broadcast bytes)."""
    from adaspec.distributed import mirror

    class Loopback:  # a worker whose broadcasts are rank 0's packed buffers, in order
        resident_base = base

        def __init__(self, packed):
            self.packed = list(packed)

        def receive_bytes(self, nbytes, kind):
            return self.packed.pop(0).clone()

    enc, dec = [], []
    for _ in range(iters):
        t0 = time.perf_counter()
        msg, packed = mirror.encode(call, base)
        t1 = time.perf_counter()
        mirror.decode(msg, Loopback(packed))
        t2 = time.perf_counter()
        enc.append(t1 - t0)
        dec.append(t2 - t1)
    return enc, dec, len(msg), sum(p.numel() for p in packed)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--gap-ms", type=float, default=0.0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from adaspec.distributed.driver import launch

    import adaspec.distributed.driver as drv

    driver = launch(2, torch.device("cpu"), bench_worker, ())
    drv.encode = _after(drv.encode, "encoded")
    driver.conns = [TimedConn(c) for c in driver.conns]
    stub = Stub()
    rows = []
    try:
        # one all-reduce between two waiting ranks: the stub forward's own cost
        ar = []
        for _ in range(args.warmup + args.iters // 10):
            t0 = time.perf_counter()
            driver.call("runner", "sync", stub.sync, (10,), {})
            t1 = time.perf_counter()
            driver.call("runner", "sync", stub.sync, (0,), {})
            ar.append(((t1 - t0) - (time.perf_counter() - t1)) / 10)
        ar_s = statistics.median(ar[args.warmup:])
        print(f"one all-reduce between waiting ranks: {1e6 * ar_s:.1f} us")
        for label, (name, method, a, kw) in payloads().items():
            fn = getattr(stub, method)
            enc, dec, msg_bytes, bcast_bytes = time_codec((name, method, a, kw), driver.resident_base, args.iters)
            starts, ends = [], []
            stub.entered.clear()
            for v in MARKS.values():
                v.clear()
            n = args.warmup + args.iters
            for _ in range(n):
                t0 = time.perf_counter() + args.gap_ms / 1e3
                while time.perf_counter() < t0:
                    pass
                t0 = time.perf_counter()
                driver.call(name, method, fn, a, kw)
                ends.append(time.perf_counter() - t0)
                starts.append(t0)
            encoded, sent, local = MARKS["encoded"][:n], MARKS["sent"][:n], stub.entered[:n]
            w_recv, w_decoded, w_entered = driver.call("runner", "report", stub.report, (n,), {})
            sl = slice(args.warmup, None)

            def phase(end, start):
                return _med_us([e - s for e, s in zip(end[sl], start[sl])])

            r = {"payload": label, "message_bytes": msg_bytes, "broadcast_bytes": bcast_bytes,
                 "rank0_encode_us": phase(encoded, starts), "rank0_send_us": phase(sent, encoded),
                 "rank0_blocked_us": phase(local, starts),
                 "worker_pipe_us": phase(w_recv, encoded), "worker_decode_us": phase(w_decoded, w_recv),
                 "worker_dispatch_us": phase(w_entered, w_decoded), "worker_lag_us": phase(w_entered, starts),
                 "call_minus_allreduce_us": round(1e6 * (statistics.median(ends[sl]) - ar_s), 1),
                 "alone_encode_us": _med_us(enc), "alone_decode_us": _med_us(dec)}
            rows.append(r)
            print("  ".join(f"{k}={v}" for k, v in r.items()), flush=True)
    finally:
        driver.shutdown()
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "tp_handshake_bench.json").write_text(json.dumps(
        {"iters": args.iters, "gap_ms": args.gap_ms, "allreduce_us": round(1e6 * ar_s, 1), "cpus": os.cpu_count(),
         "torch": torch.__version__, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":  # spawn re-imports this module in the worker: nothing may run at import
    sys.exit(main())
