"""The model runner: turns a step's schedule into one packed batch, runs the model, samples.

No policy here: the scheduler decided who runs and how many tokens each computes. The runner owns the
KV cache tensors (one key and one value tensor per layer, `[num_blocks, block_size, num_kv_heads,
head_dim]`) and builds, without padding, the step's token ids, positions, slot mapping, block tables
and query/sequence lengths (`ModelInput`), and with LoRA each token's adapter slot (after copying the
step's adapters into the model's slots, `LoRASlots.activate`); under tensor parallelism rank 0 builds it
once and every rank runs the model on it. Each step it has the kernel backend prepare the attention metadata once for all
layers, and builds the sampling inputs of the rows that sample as tensors (`SamplingMetadata`).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from conveyor.kernels import AttentionMetadata, KernelBackend
from conveyor.kernels import cpu as cpu_kernels
from conveyor.kernels.cpu import DecoderLayers
from conveyor.server import capacity
from conveyor.server.engine.request import Request
from conveyor.server.engine.scheduler import SchedulerOutput
from conveyor.server.engine.structured_output import grammar_bitmask
from conveyor.server.messages import MAX_LOGPROBS, Logprob
from conveyor.server.model.lora import LoRASlots
from conveyor.server.model.models.llama import LlamaForCausalLM
from conveyor.server.model.sampler import (
    Penalties,
    SamplingMetadata,
    Truncation,
    sample,
)

if TYPE_CHECKING:
    from conveyor.server.model.worker import Workers

logger = logging.getLogger(__name__)


@dataclass
class RunnerOutput:
    """One step's new tokens: per request that sampled (`request_ids`, in schedule order), its tokens
    (`token_ids[i]`: accepted draft tokens, then the model's own; one token without drafts) and each
    token's Logprob (None where not asked for)."""

    request_ids: list[str]
    token_ids: list[list[int]]
    logprobs: list[list[Logprob | None]]


@dataclass
class ModelInput:
    """One step's packed batch, built on the CPU (rank 0 sends it to the other ranks as it is).

    input_ids, positions: `[num_tokens]` int64; meta: the step's AttentionMetadata; logits_rows:
    `[num_sampling_rows]` int64 indices of the tokens whose logits are sampled (each sampling
    request's last known token, then its draft tokens, if any); lora_indices: `[num_tokens]` int64 LoRA slot of each token (-1: the base
    model), None when no token has an adapter; rope_lengths: `[num_tokens]` int64, the length each
    token's rotary angles are chosen by (`LlamaForCausalLM.rotary_table`), for a model whose angles
    depend on it (`ModelShape.rope_by_length`), else None.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: torch.Tensor
    lora_indices: torch.Tensor | None = None
    rope_lengths: torch.Tensor | None = None


class ModelRunner:
    """Runs `model` over a paged KV cache of blocks of `block_size` tokens.

    The KV cache is allocated by `allocate_kv_cache` once its size is settled (on CUDA after
    `profile_kv_pool_bytes` has measured what a step needs); until then the runner holds none. Under
    tensor parallelism every rank has a runner over its shard and its share of the KV cache (its KV
    heads); rank 0's runner also has `workers` (the other ranks, `conveyor.server.model.worker`), which
    it tells to allocate and run each step with it.

    The forward pass: with the C++ CPU backend on one rank the whole layer loop of the native decoder
    runs as one C++ call (`kernels.cpu.DecoderLayers`, `layer_loop`), since that measured 1.04-1.28x
    faster end to end than the Python layers (fewer dispatches; most at small batches); the Python
    layers run elsewhere, and for steps with prefill rows of models with sliding windows or soft caps.
    Both compute the same thing: a change to the model's layers must be made to `kernels/csrc/decoder.cpp`
    too (tests/integration/test_kernels_decoder.py compares them).
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        ops: KernelBackend,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        workers: Workers | None = None,
    ) -> None:
        self.model = model
        self.ops = ops
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self.workers = workers
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        # Whether the sliding layers' K/V has blocks of its own (`allocate_kv_cache`'s num_window_blocks).
        self.window_blocks = False
        self.layer_loop = fused_layer_loop(model, ops, device)
        self.lora: LoRASlots | None = None
        # Whether steps carry each token's rope length (`ModelInput.rope_lengths`).
        self.rope_by_length = model.shape.rope_by_length

    def enable_lora(self, max_loras: int, max_lora_rank: int) -> LoRASlots:
        """Give the model `max_loras` adapter slots of rank `max_lora_rank` (`LoRASlots`); steps whose
        tokens all run the base model keep the fused layer loop. Raises ValueError where LoRA does not
        run (see `LoRASlots`)."""
        self.lora = LoRASlots(self.model, self.ops, max_loras, max_lora_rank, self.dtype, self.device)
        return self.lora

    def allocate_kv_cache(self, num_blocks: int, num_window_blocks: int | None = None) -> None:
        """(Re)allocate the KV cache on every rank: one key and one value tensor per layer, `[num_blocks,
        block_size, num_kv_heads of this rank, head_dim]` in the runner's dtype; with
        `num_window_blocks`, the sliding layers' (`ModelShape.sliding_layers`) have that many blocks,
        addressed by the requests' window block tables (`AttentionMetadata.window`)."""
        if self.workers is not None:
            self.workers.tell("allocate_kv_cache", (num_blocks, num_window_blocks))
        self.kv_caches = []  # the old pool is freed first
        shape = self.model.shape
        sliding = getattr(shape, "sliding_layers", ()) or (False,) * shape.num_layers
        self.window_blocks = num_window_blocks is not None

        def cache_pair(blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
            # torch.empty: on CPU the pages are only touched when blocks are first written.
            size = (blocks, self.block_size, self.model.partition.num_kv_heads, shape.head_dim)
            return (
                torch.empty(size, dtype=self.dtype, device=self.device),
                torch.empty(size, dtype=self.dtype, device=self.device),
            )

        self.kv_caches = [
            cache_pair(num_window_blocks if slides and self.window_blocks else num_blocks)
            for slides in sliding
        ]

    def profile_kv_pool_bytes(self, num_tokens: int, gpu_memory_utilization: float) -> int:
        """The bytes of CUDA memory left for the KV cache: `gpu_memory_utilization` of the device's
        total memory minus the peak of one step of `num_tokens` tokens (weights, activations, a KV
        cache just big enough for the step), measured by running it (vLLM's `determine_available_memory`).
        Leaves the runner without a KV cache. Raises capacity.InsufficientGPUMemoryError when nothing
        is left."""
        torch.cuda.reset_peak_memory_stats()
        self.allocate_kv_cache(-(-num_tokens // self.block_size))
        self.profile(num_tokens)
        peak = torch.cuda.max_memory_allocated()
        self.allocate_kv_cache(0)
        torch.cuda.empty_cache()
        budget = int(torch.cuda.mem_get_info()[1] * gpu_memory_utilization)
        if budget - peak <= 0:
            raise capacity.InsufficientGPUMemoryError(peak, budget)
        return budget - peak

    def prepare_inputs(
        self, schedule: SchedulerOutput, lora_slots: dict[int, int] | None = None
    ) -> ModelInput:
        """The step's token ids, positions, slot mapping, block tables and query/sequence lengths,
        without padding, in schedule order; with `lora_slots` (adapter uid -> slot), each token's
        adapter slot."""
        scheduled = schedule.scheduled
        rows = []
        for sched in scheduled:
            request = sched.request
            start = request.num_computed_tokens
            known = request.all_token_ids[start : start + sched.num_new_tokens - len(sched.spec_token_ids)]
            rows.append((known + sched.spec_token_ids, start, request.block_table))
        rope_floors = [s.request.rope_length for s in scheduled] if self.rope_by_length else None
        window_tables = [s.request.window_block_table for s in scheduled] if self.window_blocks else None
        inputs = pack_rows(rows, self.block_size, rope_floors, window_tables)
        # The last known token and every draft token of each sampling request are sampled.
        ends = inputs.meta.query_start_loc.tolist()[1:]
        inputs.logits_rows = torch.tensor(
            [
                row
                for end, s in zip(ends, scheduled, strict=True)
                if s.samples
                for row in range(end - 1 - len(s.spec_token_ids), end)
            ],
            dtype=torch.long,
        )
        if lora_slots:
            inputs.lora_indices = torch.from_numpy(
                np.repeat(
                    [-1 if s.request.lora is None else lora_slots[s.request.lora.uid] for s in scheduled],
                    [s.num_new_tokens for s in scheduled],
                ).astype(np.int64)
            )
        return inputs

    @torch.inference_mode()
    def forward(self, inputs: ModelInput) -> torch.Tensor | None:
        """The model over `inputs`, writing their K/V into the cache. Returns float32 logits `[num_rows,
        vocab_size]` on the CPU for `inputs.logits_rows` (None when there are none, and on ranks other
        than 0). The step's attention metadata is prepared for the kernel backend here, once
        (`KernelBackend.prepare_metadata`), and every layer reads it."""
        dev = self.device
        meta = inputs.meta
        positions = inputs.positions.to(dev)
        table, extra = self.model.cos_sin_cache, {}
        if inputs.rope_lengths is not None:  # the step's own rotary rows, indexed 0 .. num_tokens - 1
            table, positions = self.model.rotary_table(positions, inputs.rope_lengths.to(dev))
            extra = {"cos_sin_cache": table}
        if dev.type != "cpu":
            meta = _to_device(meta, dev)
        input_ids = inputs.input_ids.to(dev)
        lora_indices = None if inputs.lora_indices is None else inputs.lora_indices.to(dev)
        if self.lora is not None:
            self.lora.context.indices = lora_indices
        if self.layer_loop is not None and self.layer_loop.runs(meta.max_query_len, meta.max_seq_len):
            lora = None if lora_indices is None else (*self.lora.loop_arguments(), lora_indices)
            hidden = self.layer_loop(
                self.model.embed(input_ids), positions, table, self.kv_caches, meta, lora
            )
        else:
            # Once per step, for every layer: what the kernels derive from the metadata (this rank's heads).
            def prepare(m: AttentionMetadata) -> AttentionMetadata:
                heads = self.model.partition.num_kv_heads
                prepared = self.ops.prepare_metadata(m, positions, table, self.block_size, heads)
                return dataclasses.replace(m, prepared=prepared)

            meta = prepare(meta)
            if meta.window is not None:
                meta = dataclasses.replace(meta, window=prepare(meta.window))
            hidden = self.model(input_ids, positions, self.kv_caches, meta, **extra)
        if not len(inputs.logits_rows):
            return None
        logits = self.model.compute_logits(hidden[inputs.logits_rows.to(dev)])
        return None if logits is None else logits.to("cpu", torch.float32)

    def take_expert_tokens(self) -> list[list[int]] | None:
        """Tokens routed to each expert since the last call, per sparse layer (`[num_sparse_layers]
        [num_experts]`), then zeroed; None for a dense model or transformers' implementation."""
        take = getattr(self.model, "take_expert_tokens", None)
        counts = take() if take is not None else None
        return None if counts is None else counts.tolist()

    @torch.inference_mode()
    def execute(self, schedule: SchedulerOutput) -> RunnerOutput:
        """Run one step (on every rank) and sample: one token per sampling request, or with draft
        tokens the accepted ones and one more (requests mid-way through a chunked prefill compute K/V
        only). The sampling inputs are built here as tensors (`build_sampling_metadata`), one row per
        sampled position, for the sampler."""
        adapters = [s.request.lora for s in schedule.scheduled if s.request.lora is not None]
        lora_slots = self.lora.activate(adapters) if adapters and self.lora is not None else None
        inputs = self.prepare_inputs(schedule, lora_slots)
        if self.workers is not None:
            self.workers.tell("forward", inputs)
        logits = self.forward(inputs)
        if logits is None:
            return RunnerOutput([], [], [])
        sampling = [s for s in schedule.scheduled if s.samples]
        # Row j of a request with drafts d_1..d_k sees the request as if d_1..d_j were accepted.
        metadata = build_sampling_metadata(
            [s.request for s in sampling for _ in range(len(s.spec_token_ids) + 1)],
            logits.shape[1],
            [s.spec_token_ids[:j] for s in sampling for j in range(len(s.spec_token_ids) + 1)],
        )
        drafts = [d for s in sampling for d in [*s.spec_token_ids, -1]]
        has_drafts = len(drafts) > len(sampling)
        out = sample(logits, metadata, torch.tensor(drafts) if has_drafts else None)
        token_ids, logprobs, row = [], [], 0
        for s in sampling:
            # The accepted drafts, then the model's token at the first rejected position (or after all).
            accepted = 0
            while accepted < len(s.spec_token_ids) and out.accepted[row + accepted]:
                accepted += 1
            token_ids.append(out.token_ids[row : row + accepted + 1])
            logprobs.append(out.logprobs[row : row + accepted + 1])
            row += len(s.spec_token_ids) + 1
        return RunnerOutput([s.request.request_id for s in sampling], token_ids, logprobs)

    @torch.inference_mode()
    def profile(self, num_tokens: int, all_logits: bool = False) -> None:
        """One forward pass of a single `num_tokens`-token prompt (on every rank), to measure peak
        activation memory, or with `all_logits` (logits of every token, as a step verifying draft
        tokens computes them) a step's time. The KV cache must hold at least
        `ceil(num_tokens / block_size)` blocks."""
        num_blocks = -(-num_tokens // self.block_size)
        inputs = ModelInput(
            input_ids=torch.zeros(num_tokens, dtype=torch.long),
            positions=torch.arange(num_tokens),
            meta=AttentionMetadata(
                slot_mapping=torch.arange(num_tokens),
                block_tables=torch.arange(num_blocks, dtype=torch.int32)[None, :],
                query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32),
                seq_lens=torch.tensor([num_tokens], dtype=torch.int32),
                max_query_len=num_tokens,
                max_seq_len=num_tokens,
            ),
            logits_rows=torch.arange(num_tokens) if all_logits else torch.tensor([num_tokens - 1]),
        )
        if self.workers is not None:
            self.workers.tell("forward", inputs)
        self.forward(inputs)


def _to_device(meta: AttentionMetadata, dev: torch.device) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping.to(dev),
        block_tables=meta.block_tables.to(dev),
        query_start_loc=meta.query_start_loc.to(dev),
        seq_lens=meta.seq_lens.to(dev),
        max_query_len=meta.max_query_len,
        max_seq_len=meta.max_seq_len,
        window=None if meta.window is None else _to_device(meta.window, dev),
    )


def _slots_and_tables(
    positions: list[np.ndarray], tables: list[list[int]], block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The slot mapping `[num_tokens]` int64 of rows at `positions` through their block `tables`, and
    the tables padded to one `[num_rows, max_blocks]` int32 tensor."""
    padded = np.zeros((len(tables), max(len(table) for table in tables)), dtype=np.int32)
    slots = []
    for row, (pos, block_table) in enumerate(zip(positions, tables, strict=True)):
        table = np.asarray(block_table, dtype=np.int64)
        slots.append(table[pos // block_size] * block_size + pos % block_size)
        padded[row, : len(table)] = table
    return torch.from_numpy(np.concatenate(slots)), torch.from_numpy(padded)


def pack_rows(
    rows: list[tuple[list[int], int, list[int]]],
    block_size: int,
    rope_floors: list[int] | None = None,
    window_tables: list[list[int]] | None = None,
) -> ModelInput:
    """One packed batch of `rows`, each (token ids, the position of the first, the sequence's block table
    of `block_size`-token blocks covering every position written): their K/V go to the slots the tables
    give, and the logits of each row's last token are computed (`logits_rows`). With `rope_floors`
    (each row's `Request.rope_length`), each token's rope length too: max(floor, position + 1). With
    `window_tables` (each row's `Request.window_block_table`), the sliding layers' slots and tables too
    (`AttentionMetadata.window`)."""
    input_ids: list[int] = []
    positions: list[np.ndarray] = []
    query_start_loc = [0]
    seq_lens: list[int] = []
    for tokens, start, _ in rows:
        end = start + len(tokens)
        input_ids.extend(tokens)
        positions.append(np.arange(start, end))
        query_start_loc.append(end - start + query_start_loc[-1])
        seq_lens.append(end)
    slot_mapping, block_tables = _slots_and_tables(positions, [table for _, _, table in rows], block_size)
    meta = AttentionMetadata(
        slot_mapping=slot_mapping,
        block_tables=block_tables,
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        max_query_len=max(len(tokens) for tokens, _, _ in rows),
        max_seq_len=max(seq_lens),
    )
    if window_tables is not None:
        slot_mapping, block_tables = _slots_and_tables(positions, window_tables, block_size)
        meta = dataclasses.replace(
            meta, window=dataclasses.replace(meta, slot_mapping=slot_mapping, block_tables=block_tables)
        )
    rope_lengths = None
    if rope_floors is not None:
        rope_lengths = torch.from_numpy(
            np.concatenate([np.maximum(pos + 1, n) for pos, n in zip(positions, rope_floors, strict=True)])
        )
    return ModelInput(
        input_ids=torch.tensor(input_ids, dtype=torch.long),
        positions=torch.from_numpy(np.concatenate(positions)),
        meta=meta,
        logits_rows=torch.tensor(query_start_loc[1:], dtype=torch.long) - 1,
        rope_lengths=rope_lengths,
    )


def fused_layer_loop(
    model: LlamaForCausalLM, ops: KernelBackend, device: torch.device
) -> DecoderLayers | None:
    """The C++ layer loop over `model`'s (packed) weights where it runs: the C++ CPU backend, a CPU
    device, one rank, and the native decoder (`LlamaForCausalLM`) without experts, q/k norms over all
    heads or OLMo 2's norm placement. None elsewhere (the model's Python layers run)."""
    if device.type != "cpu" or ops is not cpu_kernels or model.tp.size != 1:
        return None
    if not isinstance(model, LlamaForCausalLM):  # transformers' own layers (`--model-impl transformers`)
        return None
    shape = model.shape
    if shape.num_experts or shape.qk_norm_all_heads or shape.post_norms:  # features the layer loop lacks
        return None
    return cpu_kernels.DecoderLayers(model.decoder_spec())


def build_sampling_metadata(
    requests: list[Request], vocab_size: int, drafts_before: list[list[int]] | None = None
) -> SamplingMetadata:
    """The sampling inputs of a step's sampling rows as tensors (vLLM v1's `SamplingMetadata`, which its
    runner's input batch builds): requests[i] owns logits row i; `drafts_before[i]`, the request's draft
    tokens before that row (a request with drafts owns several rows), count as its outputs for
    `min_tokens` and the penalties, and advance its grammar, since the row is used only where they are
    accepted. logit_bias token ids must be in
    [0, vocab_size) (the API validates them); stop and EOS ids outside it are left out of the bans, and
    output ids outside it out of the penalties. Parts no row uses are None, so a step of plain greedy
    rows builds none of them."""
    grammar_rows = [
        i for i, r in enumerate(requests) if r.grammar is not None and not r.grammar.is_terminated()
    ]
    bitmask = (
        grammar_bitmask([r.grammar for r in requests], grammar_rows, vocab_size, drafts_before)
        if grammar_rows
        else None
    )
    return SamplingMetadata(
        num_rows=len(requests),
        grammar_rows=grammar_rows,
        grammar_bitmask=bitmask,
        logit_bias=_logit_bias(requests),
        penalties=_penalties(requests, vocab_size, drafts_before or [[]] * len(requests)),
        banned=_banned(requests, vocab_size, drafts_before or [[]] * len(requests)),
        random=_truncation(requests, vocab_size),
        logprobs=[
            None if r.sampling_params.logprobs is None else min(r.sampling_params.logprobs, MAX_LOGPROBS)
            for r in requests
        ],
    )


def _flat(pairs: list[tuple[int, list[int]]], vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[(row, token ids)] -> (rows, token ids) as flat int64 tensors, ids outside the vocabulary dropped."""
    rows = [row for row, ids in pairs for t in ids if 0 <= t < vocab_size]
    ids = [t for _, ids in pairs for t in ids if 0 <= t < vocab_size]
    return torch.tensor(rows, dtype=torch.long), torch.tensor(ids, dtype=torch.long)


def _logit_bias(requests: list[Request]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    biased = [
        (row, r.sampling_params.logit_bias) for row, r in enumerate(requests) if r.sampling_params.logit_bias
    ]
    if not biased:
        return None
    rows = torch.tensor([row for row, bias in biased for _ in bias], dtype=torch.long)
    ids = torch.tensor([t for _, bias in biased for t in bias], dtype=torch.long)
    values = torch.tensor([v for _, bias in biased for v in bias.values()], dtype=torch.float32)
    return rows, ids, values


def _penalties(requests: list[Request], vocab_size: int, drafts_before: list[list[int]]) -> Penalties | None:
    rows = [i for i, r in enumerate(requests) if r.sampling_params.has_penalties]
    if not rows:
        return None
    params = [requests[i].sampling_params for i in rows]

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32)[:, None]

    def per_row_counts(token_lists: list[list[int]]) -> torch.Tensor:
        """`[P, vocab_size]` counts of each row's tokens, by one bincount over `row * vocab + token`."""
        flat_rows, flat_ids = _flat(list(enumerate(token_lists)), vocab_size)
        counts = torch.bincount(flat_rows * vocab_size + flat_ids, minlength=len(token_lists) * vocab_size)
        return counts.view(len(token_lists), vocab_size)

    repetition = any(p.repetition_penalty != 1.0 for p in params)
    additive = any(p.presence_penalty or p.frequency_penalty for p in params)
    return Penalties(
        rows=torch.tensor(rows, dtype=torch.long),
        repetition=column([p.repetition_penalty for p in params]) if repetition else None,
        seen=per_row_counts([requests[i].all_token_ids + drafts_before[i] for i in rows]) > 0
        if repetition
        else None,
        presence=column([p.presence_penalty for p in params]) if additive else None,
        frequency=column([p.frequency_penalty for p in params]) if additive else None,
        output_counts=(
            per_row_counts([requests[i].output_token_ids + drafts_before[i] for i in rows]).float()
            if additive
            else None
        ),
    )


def _banned(
    requests: list[Request], vocab_size: int, drafts_before: list[list[int]]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Before `min_tokens` outputs, EOS and stop token ids cannot be sampled (vLLM's min_tokens). A
    request with a grammar is left to it: the grammar alone says when its output may end."""
    pairs = []
    for row, (r, drafts) in enumerate(zip(requests, drafts_before, strict=True)):
        p = r.sampling_params
        if len(r.output_token_ids) + len(drafts) < p.min_tokens and r.grammar is None:
            ids = list(p.stop_token_ids)
            if r.eos_token_id is not None and not p.ignore_eos:
                ids.append(r.eos_token_id)
            if ids:
                pairs.append((row, ids))
    return _flat(pairs, vocab_size) if pairs else None


def _truncation(requests: list[Request], vocab_size: int) -> Truncation | None:
    rows = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
    if not rows:
        return None
    params = [requests[i].sampling_params for i in rows]
    uses_top = any(p.top_k > 0 or p.top_p < 1 for p in params)
    return Truncation(
        rows=torch.tensor(rows, dtype=torch.long),
        temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32)[:, None],
        min_p=(
            torch.tensor([p.min_p for p in params], dtype=torch.float32)[:, None]
            if any(p.min_p > 0 for p in params)
            else None
        ),
        top_k=torch.tensor([p.top_k if p.top_k > 0 else vocab_size for p in params]) if uses_top else None,
        top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32)[:, None] if uses_top else None,
        generators={
            j: requests[i].generator for j, i in enumerate(rows) if requests[i].generator is not None
        },
    )
