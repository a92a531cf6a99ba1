"""A rank's view of tensor parallelism: who it is, its device and groups, and the few calls the
engine makes (shard, agree on the KV block count, mirror the model-facing objects)."""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from adaspec.distributed import resident
from adaspec.distributed.sharding import local_kv_heads, shard_drafter, shard_target
from adaspec.errors import AdaspecError

_WORKER: "TPContext | None" = None  # set in a worker process before it builds its engine


class WorkerDiedError(AdaspecError, RuntimeError):
    """A tensor-parallel worker process is gone: the engine cannot run another step."""


def collective_timeout() -> timedelta:
    """How long a collective may wait for a peer before failing (a hung rank); death is
    noticed much sooner (driver.py watches the processes)."""
    return timedelta(seconds=float(os.environ.get("ADASPEC_TP_TIMEOUT_S", "300")))


def leave_group(timeout_s: float = 10.0) -> bool:
    """destroy_process_group, given up after timeout_s (it has been seen to hang after NCCL work
    was captured in CUDA graphs, pytorch#115388): a stuck teardown must not keep the process
    alive. -> whether it finished."""
    import threading

    if not dist.is_initialized():
        return True
    t = threading.Thread(target=dist.destroy_process_group, name="adaspec-tp-destroy", daemon=True)
    t.start()
    t.join(timeout_s)
    return not t.is_alive()


class TPContext:
    def __init__(self, rank: int, size: int, device: torch.device):
        self.rank, self.size, self.device = rank, size, device
        self.group = None  # the default group: NCCL on CUDA, gloo on CPU
        self.cpu_group = None  # gloo, for host tensors when the default group is NCCL
        self.resident_base = resident.mark()

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def init_process_group(self, store) -> None:
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.size,
                                timeout=collective_timeout())
        self.group = dist.group.WORLD
        self.cpu_group = dist.new_group(backend="gloo") if backend == "nccl" else self.group

    def group_for(self, device_kind: str):
        return self.group if device_kind == self.device.type else self.cpu_group

    # -- what the engine calls (the same calls, in the same order, on every rank) ------------
    def shard_target(self, model) -> None:
        shard_target(model, self.rank, self.size, self.group)

    def shard_drafter(self, drafter) -> None:
        shard_drafter(drafter, self.rank, self.size, self.group)

    def local_kv_heads(self, num_kv_heads: int) -> int:
        return local_kv_heads(num_kv_heads, self.size)

    def agree_num_blocks(self, n: int) -> int:
        """Every rank must allocate the same number of KV blocks: the smallest any rank can hold."""
        t = torch.tensor([n], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def mirror(self, name: str, obj):
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError


def join_tensor_parallel(config, device: torch.device) -> TPContext | None:
    """None for tensor_parallel_size 1. In a worker process: that worker's context. Otherwise
    this process becomes rank 0: it checks the configuration, starts the workers and joins
    the process group with them."""
    if config.tensor_parallel_size == 1:
        return None
    if _WORKER is not None:
        return _WORKER
    from adaspec.distributed.driver import start_driver

    return start_driver(config, device)
