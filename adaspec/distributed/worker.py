"""Ranks 1..N-1: join the group, build the same engine as rank 0 (sharded model and caches,
CUDA graphs), then run each model call rank 0 announces until it says stop or goes away."""
from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time

import torch

from adaspec.distributed import context
from adaspec.distributed.mirror import decode


class Worker(context.TPContext):
    def __init__(self, rank: int, size: int, device: torch.device):
        super().__init__(rank, size, device)
        self.objects: dict[str, object] = {}

    def mirror(self, name: str, obj):
        """The object rank 0 will name in its calls; the engine keeps using it as is."""
        self.objects[name] = obj
        return obj

    def receive_bytes(self, nbytes: int, kind: str) -> torch.Tensor:
        """One packed broadcast from rank 0 (mirror.py) into a new buffer on this rank."""
        t = torch.empty(nbytes, dtype=torch.uint8, device=self.device if kind == self.device.type else "cpu")
        if nbytes:
            torch.distributed.broadcast(t, src=0, group=self.group_for(t.device.type))
        return t

    def serve(self, conn) -> None:
        while True:
            try:
                data = conn.recv_bytes()
            except (EOFError, OSError):  # rank 0 is gone
                return
            if data == b"shutdown":
                return
            name, method, args, kwargs = decode(data, self)
            with torch.no_grad():
                getattr(self.objects[name], method)(*args, **kwargs)


def _keep_alive(parent_pid: int, beat) -> None:
    """A heartbeat rank 0 watches (a frozen worker stops beating: driver.py), and an exit when
    rank 0 was killed outright, even while this process is blocked inside a collective."""
    while True:
        beat.value = time.monotonic()
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(1)


def join(index: int, port: int, size: int, conns, parent_pid: int, beats, device: torch.device):
    """A worker's start: signals, heartbeat, rendezvous with rank 0. -> (Worker, its channel from rank 0)."""
    # the terminal's Ctrl-C and a SIGTERM for the server are rank 0's to handle (it drains, then
    # stops the workers): a worker that died of them would kill the drain
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_keep_alive, args=(parent_pid, beats[index]), daemon=True).start()
    rank = index + 1
    if device.type == "cuda":
        device = torch.device("cuda", rank)
    else:  # CPU ranks share the cores: do not oversubscribe them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    worker = Worker(rank, size, device)
    store = torch.distributed.TCPStore("127.0.0.1", port, size, is_master=False, timeout=context.collective_timeout())
    store.set(f"adaspec/up/{rank}", "1")  # rank 0 waits for this while watching the processes (driver.py)
    worker.init_process_group(store)
    return worker, conns[index]


def leave() -> None:
    context.leave_group()
    # skip the interpreter's teardown: this torch build's gloo sometimes aborts there ("terminate
    # called without an active exception"), which would turn a clean stop into exit code -6
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def worker_main(index: int, config, port: int, size: int, conns, parent_pid: int, beats) -> None:
    from adaspec.engine.llm_engine import LLMEngine, resolve_device

    worker, conn = join(index, port, size, conns, parent_pid, beats, resolve_device(config.device))
    context._WORKER = worker
    config = dataclasses.replace(config, skip_tokenizer_init=True)  # rank 0 alone reads and writes text
    engine = LLMEngine(config)  # returns once its part of the start-up (collectives included) is done
    worker.serve(conn)  # `engine` holds the KV caches the calls name
    engine.release_cuda_graphs()  # before the group goes: see Driver.before_leave
    del engine
    leave()


def allocate_drafter_caches(engine, drafter_setup, num_slots: int) -> None:
    """The worker's drafter KV caches: the same call, at the same point of the start-up, as
    SpeculativeDecoder's on rank 0 (resident.py relies on the allocation order)."""
    if drafter_setup is None:
        return
    from adaspec.engine.kv_cache import allocate_kv_caches

    n_layers, n_kv, hd = drafter_setup.drafter.kv_cache_spec()
    engine.drafter_kv_caches = allocate_kv_caches(n_layers, num_slots, n_kv, hd, engine.dtype, engine.device)
