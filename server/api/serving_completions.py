"""`POST /v1/completions`: prompts (text or token ids) -> choices, whole or as server-sent events."""

from __future__ import annotations

import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from conveyor.server.api.prompts import completion_prompt_ids
from conveyor.server.api.protocol import CompletionRequest
from conveyor.server.api.serving import Choice, OpenAIServing, usage
from conveyor.server.api.sse import sse_response
from conveyor.server.messages import RequestOutput


class CompletionServing(OpenAIServing):
    """The completions endpoint."""

    def _completion_logprobs(self, choice: Choice) -> dict | None:
        if not choice.logprobs:
            return None
        tokens, offsets, offset = [], [], 0
        for lp in choice.logprobs:
            tokens.append(self.token_text(lp.token_id))
            offsets.append(offset)
            offset += len(tokens[-1])
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in choice.logprobs],
            "top_logprobs": [{self.token_text(t): v for t, v in lp.top} for lp in choice.logprobs],
            "text_offset": offsets,
        }

    async def completions(self, req: CompletionRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        lora_name = self.check_model(req.model)
        model = lora_name or self.model_name  # responses name the adapter a request ran under, as vLLM's
        prompts = await self.prompt_ids(completion_prompt_ids, req.prompt)
        params = req.sampling_params(req.max_tokens or 16, req.logprobs)
        requests = await self.make_requests(prompts, params, arrival, req.priority, lora_name=lora_name)
        self.admit(len(prompts) * req.n)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        stream = self.merged(requests, req.n)
        num_prompt_tokens = sum(len(p) for p in prompts)

        if req.stream:

            def delta(index: int, out: RequestOutput) -> dict:
                lp = self._completion_logprobs(Choice(index, logprobs=out.new_logprobs))
                reason = out.finish_reason.value if out.finish_reason else None
                return {"index": index, "text": out.new_text, "logprobs": lp, "finish_reason": reason}

            header = {"id": rid, "object": "text_completion", "created": created, "model": model}
            return sse_response(stream, header, num_prompt_tokens, req.include_usage, delta)

        choices = await self.collect(stream, raw, len(prompts) * req.n)
        body = {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": c.index,
                    "text": c.text,
                    "logprobs": self._completion_logprobs(c),
                    "finish_reason": c.finish_reason,
                }
                for c in choices
            ],
            "usage": usage(num_prompt_tokens, sum(len(c.token_ids) for c in choices)),
        }
        return JSONResponse(body)
