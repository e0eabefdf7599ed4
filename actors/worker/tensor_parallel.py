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

# While the group loads, a rank may wait long in a collective for a slower peer (its process
# start, its shard's load, a kernel warm-up): a dead rank is found by its process ending
# (tp_group.py) then, not by this timeout. Once it serves, `serve_with_timeout` shortens it.
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

    def serve_with_timeout(self, bound_s: float) -> None:
        """Once the group is built: its host collectives (gloo: every one on CPU, the broadcast
        of the steps on CUDA) time out after twice `bound_s` (EngineConfig
        tp_follower_timeout_s), where the liveness watchdog acts after `bound_s` (tp_liveness.py).
        It catches a peer whose process runs but never reaches the collective. The ranks meet
        in a step's collectives within moments of each other (they compute the same shapes),
        and an idle rank 0 broadcasts a tick well within the bound (worker.py), so no healthy
        group reaches it. NCCL's collectives keep GROUP_TIMEOUT: its watchdog would abort the
        process, and no two-GPU run has checked that path."""
        if self.size == 1:
            return
        from torch.distributed.distributed_c10d import _set_pg_timeout

        _set_pg_timeout(timedelta(seconds=2 * bound_s), self.cpu_group)

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
        if not length.item():  # rank 0's idle tick (worker.py): nothing more to send
            return b""
        if self.is_leader:
            payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            payload = torch.empty(int(length.item()), dtype=torch.uint8)
        dist.broadcast(payload, src=0, group=self.cpu_group)
        return data if self.is_leader else payload.numpy().tobytes()

    def close(self) -> None:
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()
