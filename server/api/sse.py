"""Server-sent events framing: OpenAI's streaming chunks, and the KV event stream's bodies."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from fastapi.responses import StreamingResponse

from conveyor.server.api.errors import APIError
from conveyor.server.api.serving import usage
from conveyor.server.messages import KVCacheEvent, KVCacheSnapshot, RequestOutput


def sse_response(
    stream: AsyncIterator[tuple[int, RequestOutput]],
    header: dict,
    num_prompt_tokens: int,
    include_usage: bool,
    delta: Callable[[int, RequestOutput], dict],
    opening: list[dict] | None = None,
) -> StreamingResponse:
    """Server-sent events of OpenAI's streaming format: `opening` choices, then one chunk per output with
    new text (or a finish), the usage chunk when asked for, and `[DONE]`."""

    def chunk(choices: list[dict], usage: dict | None = None) -> str:
        body = {**header, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    async def events() -> AsyncIterator[str]:
        completion_tokens = 0
        try:
            for choice in opening or []:
                yield chunk([choice])
            async for index, out in stream:
                if out.finished:
                    completion_tokens += out.num_output_tokens
                if out.new_text or out.finished:
                    choice = delta(index, out)
                    held_back = choice.get("delta") == {} and not choice["finish_reason"]
                    if not held_back or choice.get("logprobs"):  # a tool call still forming sends nothing
                        yield chunk([choice])
            if include_usage:
                yield chunk([], usage(num_prompt_tokens, completion_tokens))
        except APIError as exc:
            yield f"data: {exc.response().body.decode()}\n\n"
        finally:
            await stream.aclose()  # a client gone mid-stream aborts its requests now
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def kv_event_body(item: KVCacheSnapshot | KVCacheEvent) -> dict:
    """The JSON of one `/v1/kv_events` event: `snapshot` (block_size, num_blocks, hashes), `stored` or
    `evicted` (hashes), `cleared`. A hash is the block's `hash_block` digest as 32 hex digits."""
    if isinstance(item, KVCacheSnapshot):
        return {
            "type": "snapshot",
            "block_size": item.block_size,
            "num_blocks": item.num_blocks,
            "hashes": [h.hex() for h in item.block_hashes],
        }
    if item.kind == "cleared":
        return {"type": "cleared"}
    return {"type": item.kind, "hashes": [h.hex() for h in item.block_hashes]}


async def kv_event_stream(engine) -> AsyncIterator[str]:
    """`engine.kv_events()` (an AsyncEngine's) as server-sent events; a client gone unsubscribes."""
    stream = engine.kv_events()
    try:
        async for item in stream:
            yield f"data: {json.dumps(kv_event_body(item))}\n\n"
    finally:
        await stream.aclose()
