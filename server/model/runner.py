"""The model runner: turns a step's schedule into one packed batch, runs the model, samples.

No policy here: the scheduler decided who runs and how many tokens each computes. The runner owns the
KV cache tensors (one key and one value tensor per layer, `[num_blocks, block_size, num_kv_heads,
head_dim]`) and builds, without padding, the step's token ids, positions, slot mapping, block tables
and query/sequence lengths.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from conveyor.kernels import KernelBackend
from conveyor.server.engine.scheduler import SchedulerOutput
from conveyor.server.model.models.llama import AttentionMetadata, LlamaForCausalLM
from conveyor.server.model.sampler import SamplerOutput, sample

logger = logging.getLogger(__name__)


class ModelRunner:
    """Runs `model` over paged KV caches of `num_blocks` blocks of `block_size` tokens."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        ops: KernelBackend,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.model = model
        self.ops = ops
        self.block_size = block_size
        self.device = device
        shape = model.shape
        cache_shape = (num_blocks, block_size, shape.num_kv_heads, shape.head_dim)
        # torch.empty: on CPU the pages are only touched when blocks are first written.
        self.kv_caches = [
            (
                torch.empty(cache_shape, dtype=dtype, device=device),
                torch.empty(cache_shape, dtype=dtype, device=device),
            )
            for _ in range(shape.num_layers)
        ]

    @torch.inference_mode()
    def execute(self, schedule: SchedulerOutput) -> tuple[list[str], SamplerOutput]:
        """Run one step. Returns the ids of the requests that sampled a token, and the samples in that
        order (requests mid-way through a chunked prefill compute K/V only)."""
        scheduled = schedule.scheduled
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        max_blocks = max(len(s.request.block_table) for s in scheduled)
        block_tables = np.zeros((len(scheduled), max_blocks), dtype=np.int32)
        for row, sched in enumerate(scheduled):
            request = sched.request
            start = request.num_computed_tokens
            end = start + sched.num_new_tokens
            input_ids.extend(request.all_token_ids[start:end])
            pos = np.arange(start, end)
            table = np.asarray(request.block_table, dtype=np.int64)
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            query_start_loc.append(query_start_loc[-1] + sched.num_new_tokens)
            seq_lens.append(end)
            block_tables[row, : len(table)] = table

        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slots)).to(dev),
            block_tables=torch.from_numpy(block_tables).to(dev),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            max_query_len=max(s.num_new_tokens for s in scheduled),
            max_seq_len=max(seq_lens),
        )
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=dev),
            torch.from_numpy(np.concatenate(positions)).to(dev),
            self.kv_caches,
            meta,
        )
        sampling_rows = [i for i, s in enumerate(scheduled) if s.samples]
        if not sampling_rows:
            return [], SamplerOutput([], [])
        last_token_rows = torch.tensor([query_start_loc[i + 1] - 1 for i in sampling_rows], device=dev)
        logits = self.model.compute_logits(hidden[last_token_rows]).to("cpu", torch.float32)
        requests = [scheduled[i].request for i in sampling_rows]
        return [r.request_id for r in requests], sample(logits, requests)

    @torch.inference_mode()
    def profile(self, num_tokens: int) -> None:
        """One forward pass of a single `num_tokens`-token prompt, to measure peak activation memory.

        The runner must have at least `ceil(num_tokens / block_size)` blocks.
        """
        num_blocks = -(-num_tokens // self.block_size)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.arange(num_tokens, device=dev),
            block_tables=torch.arange(num_blocks, dtype=torch.int32, device=dev)[None, :],
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=dev),
            max_query_len=num_tokens,
            max_seq_len=num_tokens,
        )
        ids = torch.zeros(num_tokens, dtype=torch.long, device=dev)
        hidden = self.model(ids, torch.arange(num_tokens, device=dev), self.kv_caches, meta)
        self.model.compute_logits(hidden[-1:])
