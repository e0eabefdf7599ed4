"""One Worker rank's view of its tensor-parallel group: the collectives the model and the
Worker use, through torch.distributed (gloo on CPU, NCCL on CUDA).

With `size` 1 (no group) every collective is the identity, so the single-device path runs the
same code. Every rank of a group must call the same collectives in the same order: the ranks
run the same steps (rank 0 broadcasts each message it reads from its mailbox, see worker.py),
so they do.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

# A follower waits in a broadcast for the next plan for as long as the engine is idle; a dead
# rank is found by its process ending (worker.py), not by this timeout.
GROUP_TIMEOUT = timedelta(days=365)


class TensorParallel:
    """rank of size; `group` the torch.distributed process group (None when size is 1).
    `all_reduce_s` adds up the time spent in all_reduce, for the step trace and benchmarks."""

    def __init__(self, rank: int = 0, size: int = 1, group=None, cpu_group=None) -> None:
        self.rank = rank
        self.size = size
        self.group = group  # the device's collectives
        self.cpu_group = cpu_group if cpu_group is not None else group  # host tensors (gloo)
        self.all_reduce_s = 0.0

    @classmethod
    def single(cls) -> TensorParallel:
        return cls()

    @classmethod
    def join(cls, rank: int, size: int, init_file: str, device: torch.device) -> TensorParallel:
        """Join the group through a file every rank can reach (the run directory's, so no port
        is opened): NCCL on CUDA, gloo otherwise."""
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=size,
            timeout=GROUP_TIMEOUT,
        )
        cpu_group = (
            dist.new_group(backend="gloo", timeout=GROUP_TIMEOUT) if backend == "nccl" else None
        )
        return cls(rank, size, dist.group.WORLD, cpu_group)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place; returns it."""
        if self.size == 1:
            return tensor
        started = time.perf_counter()
        dist.all_reduce(tensor, group=self.group)
        self.all_reduce_s += time.perf_counter() - started
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Each rank's `tensor` (the same shape on every rank) concatenated along `dim` in rank
        order."""
        if self.size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def min_int(self, value: int) -> int:
        """The smallest `value` over the ranks (the KV blocks every rank can hold)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's `data` on every rank (the others pass None): its length, then its bytes,
        as host tensors over the gloo group."""
        if self.size == 1:
            return data or b""
        length = torch.tensor([len(data) if self.is_leader else 0], dtype=torch.int64)
        dist.broadcast(length, src=0, group=self.cpu_group)
        if self.is_leader:
            payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            payload = torch.empty(int(length.item()), dtype=torch.uint8)
        if payload.numel():
            dist.broadcast(payload, src=0, group=self.cpu_group)
        return data if self.is_leader else payload.numpy().tobytes()

    def close(self) -> None:
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()
