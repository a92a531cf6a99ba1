"""Rank 0: starts the workers (torch.multiprocessing spawn), joins the process group with
them, announces each mirrored model call, watches the workers and shuts them down.

Failure handling: a monitor thread waits on the workers' process sentinels. When one dies,
it logs which rank died and how (exit code, signal, or the worker's own traceback), ends the
other workers, and marks the engine failed: the call that was running (a gloo collective
fails at once when a peer's socket closes) or the next one raises WorkerDiedError. If rank 0
does not surface that within a few seconds (it may be blocked in an NCCL collective that never
completes, or idle), the process exits with status 1: a server must not stay up without its
workers. A worker whose heartbeat stops (a frozen process) counts as dead; one that is alive
but never joins a collective fails it after ADASPEC_TP_TIMEOUT_S."""
from __future__ import annotations

import atexit
import logging
import os
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp
from torch.multiprocessing.spawn import ProcessException

from adaspec.distributed.context import TPContext, WorkerDiedError, collective_timeout, leave_group
from adaspec.distributed.mirror import Mirror, broadcast_packed, encode
from adaspec.errors import ConfigError

log = logging.getLogger("adaspec.tp")

SURFACE_GRACE_S = 5.0  # how long rank 0 may take to raise a worker's death before the process exits


def heartbeat_timeout() -> float:
    """Seconds without a worker's heartbeat (a thread beating every 0.5 s) before it counts as hung."""
    return float(os.environ.get("ADASPEC_TP_HEARTBEAT_S", "15"))


def check_config(config, device: torch.device) -> None:
    """Refuse what cannot be sharded before any process starts."""
    from adaspec.distributed.sharding import check_shardable
    from adaspec.models.loader import load_config, model_dir

    size = config.tensor_parallel_size
    if device.type == "cuda":
        if device.index not in (None, 0):
            raise ConfigError(f"tensor_parallel_size={size} uses cuda:0..cuda:{size - 1}; "
                              f"use --device cuda, not {device}")
        n = torch.cuda.device_count()
        if size > n:
            raise ConfigError(f"tensor_parallel_size={size} exceeds the {n} CUDA device(s) of this host")
    check_shardable(load_config(model_dir(config.model)), size, "the target")
    if config.speculative_config is not None:
        from adaspec.config import SpeculativeConfig
        from adaspec.models.drafter import load_drafter_config
        from adaspec.models.registry import DEFAULT_DRAFTERS

        name = SpeculativeConfig.from_dict(dict(config.speculative_config)).model or \
            DEFAULT_DRAFTERS.get(str(config.model))
        if name is not None:
            check_shardable(load_drafter_config(name)[0].base, size, "the drafter")


def start_driver(config, device: torch.device) -> "Driver":
    check_config(config, device)
    from adaspec.distributed.worker import worker_main

    return launch(config.tensor_parallel_size, device, worker_main, (config,))


def launch(size: int, device: torch.device, entry, entry_args: tuple) -> "Driver":
    """Start ranks 1..size-1 as `entry(index, *entry_args, port, size, channels, parent_pid, beats)`
    (worker.worker_main; benchmarks/tp_handshake_bench.py passes its own) and join the group with them."""
    if dist.is_initialized():  # rank 0 joins the default group, of which a process has one
        raise ConfigError("this process already belongs to a torch.distributed group (another tensor-parallel "
                          "engine?); shut that engine down first (LLMEngine.shutdown())")
    if device.type == "cuda":
        device = torch.device("cuda", 0)
    store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
                          timeout=collective_timeout())
    ctx = tmp.get_context("spawn")
    pipes = [ctx.Pipe(duplex=False) for _ in range(size - 1)]  # (worker's read end, our write end)
    beats = [ctx.Value("d", 0.0, lock=False) for _ in range(size - 1)]  # each worker's last sign of life
    procs = tmp.start_processes(
        entry, args=(*entry_args, store.port, size, [r for r, _ in pipes], os.getpid(), beats),
        nprocs=size - 1, join=False, start_method="spawn")
    for r, w in pipes:
        r.close()
        _widen(w)
    driver = Driver(size, device, procs, [w for _, w in pipes], beats)
    driver.wait_for_workers(store)
    driver.init_process_group(store)
    return driver


PIPE_BYTES = 1 << 20  # Linux's default limit for an unprivileged process (/proc/sys/fs/pipe-max-size)


def _widen(conn) -> None:
    """Let a call's message (a batch's block tables: ~6 KiB at 64 requests x 512 tokens, far more
    at long contexts) fit in the pipe, so that rank 0 never waits for the worker to read it before
    running its own part (the default pipe holds 64 KiB). Best effort: Linux only."""
    try:
        import fcntl

        fcntl.fcntl(conn.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    except (ImportError, AttributeError, OSError):
        pass


STARTUP_HINT = ("; it failed while starting (its own error is on stderr). A script that builds a tensor-parallel "
                "engine must do so under `if __name__ == \"__main__\":`: the workers are spawned and import the "
                "script's main module")


def _is_timeout(e: BaseException) -> bool:
    """A collective that waited its timeout (gloo raises RuntimeError "Timed out waiting ...")."""
    return isinstance(e, (RuntimeError, dist.DistError)) and "timed out" in str(e).lower()


class Driver(TPContext):
    def __init__(self, size: int, device: torch.device, procs, conns, beats):
        super().__init__(0, size, device)
        self.procs, self.conns, self.beats = procs, conns, beats
        self.failure: str | None = None  # set by the monitor when a worker died
        self.surfaced = threading.Event()  # the failure was raised to the engine's caller
        self.ready = False  # the engine reached its first mirror(): init collectives are over
        self._stopping = False  # worker exits from now on are expected (shutdown, or we killed them)
        self._shut = False
        # weakref.WeakMethods called before the group is left (the engine frees its CUDA graphs:
        # live graphs holding NCCL collectives make destroy_process_group hang, pytorch#115388)
        self.before_leave: list = []
        self._monitor = threading.Thread(target=self._watch, name="adaspec-tp-monitor", daemon=True)
        self._monitor.start()
        atexit.register(self.shutdown)

    def wait_for_workers(self, store) -> None:
        """Until every worker process is up and about to join the group; a worker that fails
        first (an import error, a script without the __main__ guard) raises here at once,
        instead of rank 0 waiting out the group's timeout."""
        keys = [f"adaspec/up/{r}" for r in range(1, self.size)]
        deadline = time.monotonic() + collective_timeout().total_seconds()
        while not store.check(keys):
            if self.failure is not None or time.monotonic() > deadline:
                failure = self.failure or "tensor-parallel workers did not start within ADASPEC_TP_TIMEOUT_S"
                self.shutdown()
                if "following error" not in failure:  # died before torch could record its traceback
                    failure += STARTUP_HINT
                raise WorkerDiedError(failure)
            time.sleep(0.05)

    def mirror(self, name: str, obj):
        self.ready = True
        return Mirror(name, obj, self)

    # -- one mirrored call -------------------------------------------------------------------
    def call(self, name: str, method: str, fn, args, kwargs):
        if self.failure is not None:
            self._surface()
        data, packed = encode((name, method, args, kwargs), self.resident_base)
        try:
            for conn in self.conns:
                conn.send_bytes(data)
            for buf in packed:
                broadcast_packed(buf, self)
            return fn(*args, **kwargs)
        except Exception as e:
            # a collective or the pipe failed: if a worker died, say so instead
            deadline = time.monotonic() + 3.0
            while self.failure is None and time.monotonic() < deadline and not self._stopping:
                time.sleep(0.05)
            if self.failure is None and _is_timeout(e):  # alive but not answering: hung
                self.failure = (f"a tensor-parallel collective failed while every worker process is alive "
                                f"(a hung worker? collectives wait ADASPEC_TP_TIMEOUT_S="
                                f"{collective_timeout().total_seconds():.0f} s): {str(e).splitlines()[0]}")
                log.error("%s", self.failure)
                self._kill_workers()
            if self.failure is not None:
                self._surface(e)
            raise

    def _surface(self, cause: BaseException | None = None):
        self.surfaced.set()
        raise WorkerDiedError(self.failure) from cause

    # -- watching the workers ------------------------------------------------------------------
    def _watch(self) -> None:
        limit = heartbeat_timeout()
        while not self._stopping:
            try:
                if self.procs.join(timeout=0.5, grace_period=0.5):
                    return  # all workers exited normally (shutdown)
            except ProcessException as e:
                if not self._stopping:
                    rank, how = e.error_index + 1, str(e).strip().replace(f"process {e.error_index:d} ", "")
                    self._fail(f"tensor-parallel worker rank {rank} (pid {e.error_pid}) {how}")
                return
            now = time.monotonic()
            for i, beat in enumerate(self.beats):  # alive but frozen (stopped, deadlocked): no heartbeat
                if beat.value and now - beat.value > limit and not self._stopping:
                    self._kill_workers()
                    self._fail(f"tensor-parallel worker rank {i + 1} (pid {self.procs.processes[i].pid}) has "
                               f"given no sign of life for {now - beat.value:.0f} s (hung; ADASPEC_TP_HEARTBEAT_S="
                               f"{limit:g}); the workers were killed")
                    return

    def _fail(self, what: str) -> None:
        self.failure = f"{what}; the engine stops (every rank must run every step)"
        log.error("%s", self.failure)
        if not self.ready:
            return  # start-up: rank 0's own collective fails (gloo) or times out (ADASPEC_TP_TIMEOUT_S)
        if self.surfaced.wait(SURFACE_GRACE_S):
            return
        log.error("rank 0 did not stop within %.0f s of the worker's death; exiting with status 1", SURFACE_GRACE_S)
        logging.shutdown()
        os._exit(1)

    def _kill_workers(self) -> None:
        self._stopping = True  # the monitor must not report the kills as deaths
        for p in self.procs.processes:
            if p.is_alive():
                p.kill()

    # -- shutdown ------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Tell the workers to stop, wait for them (then kill stragglers), leave the group."""
        if self._shut:
            return
        self._shut = self._stopping = True
        atexit.unregister(self.shutdown)
        for conn in self.conns:
            try:
                conn.send_bytes(b"shutdown")
                conn.close()
            except OSError:
                pass
        self._monitor.join(2.0)  # it notices _stopping within a second; only then do we reap the workers
        deadline = time.monotonic() + 10.0
        for p in self.procs.processes:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                log.warning("tensor-parallel worker pid %d did not stop; killing it", p.pid)
                p.kill()
                p.join(5.0)
        for ref in self.before_leave:  # weak references to bound methods (the engine's)
            hook = ref()
            if hook is None:
                continue
            try:
                hook()
            except Exception:  # noqa: BLE001 - leaving the group matters more than the hook
                log.exception("a tensor-parallel shutdown hook failed")
        if not leave_group():
            log.warning("torch.distributed.destroy_process_group did not return within 10 s; left behind")
