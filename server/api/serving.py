"""What both OpenAI endpoints share: model check, prompt building off the event loop, one check
per request, admission against the waiting-queue bound, and fan-out of a request's choices to the engine.

The serving classes talk to the engine through `AsyncEngine` only.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

from fastapi import Request

from conveyor.server.api.errors import APIError
from conveyor.server.api.prompts import PromptError
from conveyor.server.config import ServerConfig
from conveyor.server.engine.async_engine import AsyncEngine
from conveyor.server.engine.validation import InvalidRequestError
from conveyor.server.messages import (
    EngineRequest,
    Logprob,
    RequestOutput,
    SamplingParams,
    StructuredOutputParams,
)


@dataclass
class Choice:
    """Accumulated output of one choice (one engine request)."""

    index: int
    num_prompt_tokens: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprob] = field(default_factory=list)
    finish_reason: str | None = None


class OpenAIServing:
    """The base of the endpoint classes: HTTP requests -> engine requests, engine outputs -> choices."""

    def __init__(self, engine: AsyncEngine, config: ServerConfig) -> None:
        self.engine = engine
        self.max_waiting_requests = config.max_waiting_requests
        self.tokenizer = engine.tokenizer
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len

    # -- helpers --------------------------------------------------------------------------------------

    def check_model(self, model: str | None) -> str | None:
        """The LoRA adapter `model` names (None: the base model, also when `model` is absent). Raises a
        404 APIError (OpenAI's `model_not_found`) for a name the server does not serve (with the reason
        when `--lora-modules-file` declares it and it failed to load)."""
        if model is None or model == self.model_name:
            return None
        if model in self.engine.lora_adapters():
            return model
        failed = next((a.error for a in self.engine.lora_states() if a.name == model and a.error), None)
        if failed is not None:  # declared by --lora-modules-file, not loaded: say why
            raise APIError(404, f"The model `{model}` is not served: {failed}", "model", "model_not_found")
        raise APIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")

    async def prompt_ids(self, build: Callable, *args):
        """`build(tokenizer, *args)` (prompts.py) in a worker thread, so that tokenizing and chat
        templating do not hold up the event loop; a PromptError is a 400 naming its field."""
        try:
            return await asyncio.to_thread(build, self.tokenizer, *args)
        except PromptError as exc:
            raise APIError(400, str(exc), exc.param) from None

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    async def make_requests(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        arrival: float,
        priority: int,
        checks: list[StructuredOutputParams] = (),
        names: dict[str, str] | None = None,
        lora_name: str | None = None,
    ) -> list[EngineRequest]:
        """The engine's checked requests, one per prompt (`merged` gives each choice its own id), under
        the LoRA adapter `lora_name` (`check_model`'s answer), or a 400 for a request the engine would
        refuse: the one check a request gets. `checks`: more
        constraints that must compile (a chat request's tool schemas under `auto`); `names`: the
        request's own names of the engine's fields (chat: `prompt` is `messages`). Runs in a worker
        thread: compiling a structured-output grammar may take a while, and the event loop keeps
        serving meanwhile."""

        def check() -> list[EngineRequest]:
            for constraint in checks:
                self.engine.make_request("check", prompts[0], replace(params, structured_output=constraint))
            return [
                self.engine.make_request(str(p), prompt_ids, params, arrival, priority, lora_name)
                for p, prompt_ids in enumerate(prompts)
            ]

        try:
            return await asyncio.to_thread(check)
        except InvalidRequestError as exc:
            param, message = exc.param.split(".")[0], str(exc)  # `param`: the top-level field
            if names and param in names:
                message = message.replace(f"in {param}", f"in {names[param]}")
                param = names[param]
            raise APIError(400, message, param) from None

    def admit(self, num_requests: int) -> None:
        """429 (OpenAI's rate-limit body, `Retry-After`) when `num_requests` more would make the
        waiting queue longer than --max-waiting-requests: overload sheds load instead of growing TTFT."""
        limit = self.max_waiting_requests
        if limit is not None and num_requests > limit:  # could never be admitted: not a retry-later
            raise APIError(
                400,
                f"n: the request needs {num_requests} engine requests, more than --max-waiting-requests {limit}",
                "n",
            )
        if limit is not None and not self.engine.reserve(num_requests, limit):
            raise APIError(
                429,
                f"the server has {self.engine.num_waiting} requests waiting (--max-waiting-requests "
                f"{limit}); retry later",
                code="too_many_requests",
                headers={"Retry-After": "1"},
            )

    def merged(self, requests: list[EngineRequest], n: int) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Run every (prompt, choice) as its own engine request, queued at once (call it right after
        `admit`, whose reservations they take up); the iterator yields (choice index, output) as they
        come. Closing it aborts every request still running."""
        base = uuid.uuid4().hex
        queue: asyncio.Queue = asyncio.Queue()
        reserved = self.max_waiting_requests is not None

        unstarted: set[int] = set()  # tasks cancelled before they start hold their reservation

        async def pump(index: int, choice: EngineRequest) -> None:
            unstarted.discard(index)
            try:
                async for out in self.engine.generate(choice, reserved=reserved):
                    await queue.put((index, out))
            except Exception as exc:
                await queue.put((index, exc))

        tasks = []
        for p, request in enumerate(requests):
            seed = request.params.seed
            for i in range(n):
                index = p * n + i
                # vLLM's rule: choice i of a seeded request uses seed + i, so choices differ and repeat.
                choice = request.for_choice(f"{base}-{index}", seed + i if seed is not None else None)
                unstarted.add(index)
                tasks.append(asyncio.create_task(pump(index, choice)))
        return self._outputs(queue, tasks, requests[0].params, unstarted if reserved else set())

    async def _outputs(
        self, queue: asyncio.Queue, tasks: list[asyncio.Task], params: SamplingParams, unstarted: set[int]
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        remaining = len(tasks)
        try:
            while remaining:
                index, item = await queue.get()
                if isinstance(item, Exception):
                    raise APIError(500, f"generation failed: {item}") from item
                if item.error is not None:  # the request's own fault, found while generating
                    so = params.structured_output
                    raise APIError(400, item.error, so.param if so else None)
                if item.finished:
                    remaining -= 1
                yield index, item
        finally:
            for task in tasks:
                task.cancel()
            if unstarted:  # they will never run now
                self.engine.release(len(unstarted))
                unstarted.clear()

    async def collect(
        self, stream: AsyncIterator[tuple[int, RequestOutput]], raw: Request, num: int
    ) -> list[Choice]:
        """Gather a non-streamed response; abort everything if the client disconnects meanwhile."""
        choices = [Choice(i) for i in range(num)]

        async def gather() -> None:
            async for index, out in stream:
                c = choices[index]
                c.text += out.new_text
                c.token_ids += out.new_token_ids
                c.logprobs += out.new_logprobs
                if out.finished:
                    c.finish_reason = out.finish_reason.value if out.finish_reason else None

        task = asyncio.create_task(gather())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=0.5)
                if not task.done() and await raw.is_disconnected():
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                    await stream.aclose()
                    raise APIError(499, "client disconnected")
            task.result()
        finally:
            await stream.aclose()
        return choices


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
