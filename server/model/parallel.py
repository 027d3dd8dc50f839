"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019, as vLLM shards Llama): the process group, how a
model's heads, MLP and vocabulary are split over ranks, and the collectives the model calls.

A rank computes with plain `nn.Linear` layers sized for its shard (so the CPU path still pre-packs them
for oneDNN); the parallel structure is in where the model calls `all_reduce` and `gather_logits`:

- column-parallel (no communication): the fused q/k/v projection (each rank its query heads and their KV
  heads) and the fused gate/up projection (each rank `intermediate_size / tp` rows);
- row-parallel (partial sums, then `all_reduce`): the output projection `o_proj` and `down_proj`;
- vocabulary-parallel: each rank holds `ceil(vocab / tp)` rows of the embedding (and of the LM head, tied
  or not); a lookup zeroes ids outside the rank's rows and sums over ranks; the LM head's logits are
  gathered on rank 0, which samples.

KV heads are split like query heads when there are at least as many as ranks; with fewer, each is
replicated on `tp / num_kv_heads` ranks (vLLM's rule), so every rank holds exactly one. The split itself
(`partition`) is pure arithmetic in `conveyor.server.capacity`, which the operator checks specs with.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from conveyor.server.capacity import Partition, partition

__all__ = ["Partition", "TensorParallel", "partition"]


class TensorParallel:
    """This rank's place in the tensor-parallel group and its collectives.

    `TensorParallel()` is the single-rank case: every collective is the identity. With `size > 1` the
    process group must be initialized (`init`); `group` carries the model's tensors (NCCL on CUDA, gloo
    on CPU) and `cpu_group` (gloo) carries rank 0's per-step commands.
    """

    def __init__(self, rank: int = 0, size: int = 1, cpu_group=None) -> None:
        self.rank = rank
        self.size = size
        self.cpu_group = cpu_group

    @classmethod
    def init(cls, rank: int, size: int, init_method: str, device: torch.device) -> TensorParallel:
        """Join the group of `size` ranks at `init_method` (`tcp://127.0.0.1:PORT`); blocks until all have."""
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size)
        cpu_group = dist.new_group(backend="gloo") if backend == "nccl" else dist.group.WORLD
        return cls(rank, size, cpu_group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over ranks (in place; returned). gloo sums bfloat16/float16 in float32."""
        if self.size == 1:
            return x
        if x.device.type == "cpu" and x.dtype != torch.float32:
            wide = x.float()
            dist.all_reduce(wide)
            return x.copy_(wide)
        dist.all_reduce(x)
        return x

    def gather_logits(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """local: `[num_rows, vocab_per_rank]` -> on rank 0 the full `[num_rows, vocab_size]` (padding
        dropped), None on the others."""
        if self.size == 1:
            return local
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(local, parts, dst=0)
        return torch.cat(parts, dim=-1)[:, :vocab_size] if parts is not None else None

    def broadcast(self, obj=None):
        """Rank 0 sends `obj` (any picklable value, tensors on the CPU) to every rank; returns it on each."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def close(self) -> None:
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()
