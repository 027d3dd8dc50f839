"""`POST /v1/chat/completions`: messages (and tools) -> assistant choices with content or tool calls,
whole or as server-sent events."""

from __future__ import annotations

import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from conveyor.server.api.prompts import chat_request_prompt_ids
from conveyor.server.api.protocol import ChatCompletionRequest, NamedToolChoice
from conveyor.server.api.serving import Choice, OpenAIServing, usage
from conveyor.server.api.sse import sse_response
from conveyor.server.api.tools import TOOL_CALL_PARSERS, ToolCallReader, tool_call_json
from conveyor.server.config import ServerConfig
from conveyor.server.engine.async_engine import AsyncEngine
from conveyor.server.messages import Logprob, RequestOutput


class ChatServing(OpenAIServing):
    """The chat completions endpoint; `--tool-call-parser` picks how `auto` tool calls are read."""

    def __init__(self, engine: AsyncEngine, config: ServerConfig) -> None:
        super().__init__(engine, config)
        self.tool_parser = TOOL_CALL_PARSERS[config.tool_call_parser]()

    def _chat_logprobs(self, logprobs: list[Logprob], top_n: int | None) -> dict:
        def entry(token_id: int, logprob: float) -> dict:
            text = self.token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        content = []
        for lp in logprobs:
            item = entry(lp.token_id, lp.logprob)
            item["top_logprobs"] = [entry(t, v) for t, v in lp.top[: top_n or 0]]
            content.append(item)
        return {"content": content}

    def _tool_reader(self, req: ChatCompletionRequest) -> ToolCallReader:
        choice = req.effective_tool_choice
        if isinstance(choice, NamedToolChoice):
            return ToolCallReader("named", self.tool_parser, choice.function.name)
        known = {t.function.name for t in req.tools or []}
        return ToolCallReader(choice, self.tool_parser, known=known, parallel=req.parallel_tool_calls)

    async def chat_completions(self, req: ChatCompletionRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        lora_name = self.check_model(req.model)
        model = lora_name or self.model_name  # responses name the adapter a request ran under, as vLLM's
        prompt_ids = await self.prompt_ids(chat_request_prompt_ids, req)
        max_tokens = (
            req.max_completion_tokens or req.max_tokens or max(1, self.max_model_len - len(prompt_ids))
        )
        params = req.sampling_params(max_tokens, (req.top_logprobs or 0) if req.logprobs else None)
        names = {"prompt": "messages"}
        if req.max_completion_tokens is not None:
            names["max_tokens"] = "max_completion_tokens"
        requests = await self.make_requests(
            [prompt_ids], params, arrival, req.priority, req.tool_schema_checks(), names, lora_name
        )
        self.admit(req.n)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        stream = self.merged(requests, req.n)
        top_n = req.top_logprobs

        if req.stream:
            readers = [self._tool_reader(req) for _ in range(req.n)]

            def delta(index: int, out: RequestOutput) -> dict:
                lp = self._chat_logprobs(out.new_logprobs, top_n) if req.logprobs else None
                reader = readers[index]
                content = reader.feed(out.new_text, out.finished)
                reason = out.finish_reason.value if out.finish_reason else None
                if reader.called and reason == "stop":
                    reason = "tool_calls"
                return {"index": index, "delta": content, "logprobs": lp, "finish_reason": reason}

            header = {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
            }
            opening = [
                {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                for i in range(req.n)
            ]
            return sse_response(stream, header, len(prompt_ids), req.include_usage, delta, opening)

        choices = await self.collect(stream, raw, req.n)
        body = {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [self._chat_choice(c, req) for c in choices],
            "usage": usage(len(prompt_ids), sum(len(c.token_ids) for c in choices)),
        }
        return JSONResponse(body)

    def _chat_choice(self, c: Choice, req: ChatCompletionRequest) -> dict:
        content, calls = self._tool_reader(req).read(c.text)
        message: dict = {"role": "assistant", "content": content}
        reason = c.finish_reason
        if calls:
            message["tool_calls"] = [tool_call_json(call) for call in calls]
            reason = "tool_calls" if reason == "stop" else reason
        return {
            "index": c.index,
            "message": message,
            "logprobs": self._chat_logprobs(c.logprobs, req.top_logprobs) if req.logprobs else None,
            "finish_reason": reason,
        }
