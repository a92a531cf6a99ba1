"""Tensor parallelism across the GPUs of one host (torch.distributed: NCCL on CUDA, gloo on CPU).

One process per rank. Rank 0 is the process that built the engine: it schedules, runs the
adaptive policy and samples, as with one device. Ranks 1..N-1 are workers started with
``torch.multiprocessing`` (spawn); each holds its shard of the target and of the drafter's
backbone and its shard of the KV caches, and runs the same model calls as rank 0, in the same
order, so that the collectives inside the model meet.

- ``layers``: the parallel modules (row-parallel linear with its all-reduce, vocabulary-parallel
  embedding, vocabulary-parallel LM head whose logits are gathered on every rank);
- ``sharding``: slicing loaded weights into those modules (Megatron-style: q/k/v and gate/up by
  output rows, o/down by input columns, KV heads split or replicated as vLLM does);
- ``mirror``: how rank 0 tells the workers which model call to run (a pickled description
  over a pipe, host tensors inside it, device tensors by broadcast, KV caches by reference);
- ``driver`` (rank 0) and ``worker`` (ranks >= 1): process start, rendezvous, the workers'
  loop, death detection and shutdown.
"""
__all__ = ["TPContext", "WorkerDiedError", "join_tensor_parallel"]

from adaspec.distributed.context import TPContext, WorkerDiedError, join_tensor_parallel  # noqa: E402
