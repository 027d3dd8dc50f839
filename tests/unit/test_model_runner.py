"""The model runner's step on a two-layer random Llama and the torch kernels: the attention metadata
is prepared for the kernel backend once per step and every layer's kernels read that one object."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from conveyor.kernels import reference as ref
from conveyor.server.engine.request import Request
from conveyor.server.engine.scheduler import ScheduledRequest, SchedulerOutput
from conveyor.server.messages import SamplingParams
from conveyor.server.model.runner import ModelRunner
from tests.tiny_llama import tiny_llama


def _recording_backend(calls: dict[str, list]) -> SimpleNamespace:
    """The torch reference kernels, with what `prepare_metadata` returned and what the per-layer
    kernels received recorded in `calls`."""

    def prepare_metadata(*args):
        prepared = ref.prepare_metadata(*args)
        calls["prepare_metadata"].append(prepared)
        return prepared

    def paged_attention(*args, **options):
        calls["paged_attention"].append(args[-1])
        return ref.paged_attention(*args, **options)

    def rotary_embedding(*args):
        calls["rotary_embedding"].append(args[-1])
        return ref.rotary_embedding(*args)

    return SimpleNamespace(
        prepare_metadata=prepare_metadata,
        paged_attention=paged_attention,
        rotary_embedding=rotary_embedding,
        reshape_and_cache=ref.reshape_and_cache,
        rms_norm=ref.rms_norm,
        fused_add_rms_norm=ref.fused_add_rms_norm,
        silu_and_mul=ref.silu_and_mul,
        gelu_tanh_and_mul=ref.gelu_tanh_and_mul,
    )


def _request(rid: str, prompt: list[int], blocks: list[int]) -> Request:
    request = Request(rid, prompt, SamplingParams(temperature=0), eos_token_id=None)
    request.block_table = blocks
    return request


def test_attention_metadata_is_prepared_once_per_step_for_every_layer():
    calls: dict[str, list] = {"prepare_metadata": [], "paged_attention": [], "rotary_embedding": []}
    ops = _recording_backend(calls)
    model = tiny_llama(tie=False, dtype=torch.float32, ops=ops)
    runner = ModelRunner(model, ops, block_size=16, dtype=torch.float32, device=torch.device("cpu"))
    runner.allocate_kv_cache(8)
    decoding = _request("a", list(range(1, 21)), [1, 2])
    prefilling = _request("b", list(range(30, 37)), [3])
    first = runner.execute(SchedulerOutput([ScheduledRequest(decoding, 20)], 20))
    decoding.num_computed_tokens = 20
    decoding.append_output_tokens(first.token_ids[0])
    # A mixed step: one decode row, one 7-token prefill.
    step = SchedulerOutput([ScheduledRequest(decoding, 1), ScheduledRequest(prefilling, 7)], 8)
    out = runner.execute(step)

    assert out.request_ids == ["a", "b"] and len(out.token_ids) == 2
    assert len(calls["prepare_metadata"]) == 2  # one per step
    prepared = calls["prepare_metadata"][-1]
    assert prepared.attention.q_lens == [1, 7] and prepared.attention.decode == [0]
    num_layers = len(model.layers)
    for kernel in ("paged_attention", "rotary_embedding"):
        assert len(calls[kernel]) == 2 * num_layers
        assert all(p is prepared for p in calls[kernel][num_layers:]), kernel
