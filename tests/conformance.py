"""Token-for-token conformance with transformers: the engine and transformers' eager model decode the
same prompts greedily and must agree on every token."""

from __future__ import annotations

import torch

from conveyor.server.messages import SamplingParams


def assert_greedy_equals_transformers(
    engine, hf_model, prompts: list[list[int]], max_tokens: int, label: str
) -> list[list[int]]:
    """Serve every prompt (token ids) at once through `engine` (chunked prefill, batched decode), then
    compare each output with `hf_model.generate`'s greedy continuation of the prompt alone. Returns our
    outputs, in prompt order. Raises AssertionError naming `label` and the prompt."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(engine.make_request(str(i), ids, params))
    ours: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            ours[out.request_id] += out.new_token_ids
    for i, ids in enumerate(prompts):
        with torch.no_grad():
            ref = hf_model.generate(
                torch.tensor([ids]), max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False
            )
        assert ours[str(i)] == ref[0, len(ids) :].tolist(), f"{label}: prompt {i}"
    return [ours[str(i)] for i in range(len(prompts))]
