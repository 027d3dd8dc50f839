"""The output processor: turns each step's new tokens into `RequestOutput`s, and is the one place that
decides a request has finished.

The scheduler only appends each step's new tokens (`Scheduler.update_from_output`; several where draft
tokens were accepted); then, per request that got any, token by token, this module advances its structured-output grammar, feeds its detokenizer, and checks the
stop conditions vLLM checks (its scheduler's `check_stop` and its output processor's stop strings, here
together): EOS (once `min_tokens` are out, unless `ignore_eos`), `stop_token_ids`, `max_tokens` and
`max_model_len`, the grammar's end or dead end, and stop strings (also held back until `min_tokens`
are out, as vLLM does since vllm#21987). A finish is handed to the scheduler's
`finish_request`, which frees the request's KV blocks before the next step is scheduled.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from conveyor.server.engine.detokenizer import IncrementalDetokenizer
from conveyor.server.engine.request import Request
from conveyor.server.engine.stats import StatsObserver
from conveyor.server.engine.structured_output import StructuredOutputManager
from conveyor.server.messages import FinishReason, Logprob, RequestOutput

logger = logging.getLogger(__name__)


def stop_reason(request: Request, num_output: int, max_model_len: int) -> FinishReason | None:
    """The finish a request's output token `num_output` (1-based) causes from token ids alone: `STOP` on
    EOS (after `min_tokens`, unless `ignore_eos`) or a stop token id, `LENGTH` at `max_tokens` or
    `max_model_len`."""
    params = request.sampling_params
    token_id = request.output_token_ids[num_output - 1]
    if num_output >= params.min_tokens:
        if not params.ignore_eos and token_id == request.eos_token_id:
            return FinishReason.STOP
        if token_id in params.stop_token_ids:
            return FinishReason.STOP
    if num_output >= params.max_tokens or request.num_prompt_tokens + num_output >= max_model_len:
        return FinishReason.LENGTH
    return None


Finish = Callable[[Request, FinishReason], None]


class OutputProcessor:
    """Per-request detokenizers and the stop checks; see the module docstring.

    tokenizer: the model's transformers tokenizer. max_model_len: context length in tokens.
    observer: told of every new token and every finished request (metrics), if given.
    """

    def __init__(
        self,
        tokenizer,
        structured_output: StructuredOutputManager,
        max_model_len: int,
        observer: StatsObserver | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.structured_output = structured_output
        self.max_model_len = max_model_len
        self.observer = observer
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}

    def add_request(self, request: Request) -> None:
        self._detokenizers[request.request_id] = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, request.sampling_params
        )

    def discard(self, request_id: str) -> None:
        """Forget a request that ended without an output (its step failed)."""
        self._detokenizers.pop(request_id, None)

    def process(
        self,
        updated: list[tuple[Request, int, float | None]],
        logprobs: dict[str, list[Logprob | None]],
        finish: Finish,
    ) -> list[RequestOutput]:
        """One output per request of `updated` (`Scheduler.update_from_output`'s result: each with the
        number of tokens the step appended and the time of its previous token, None for a first one).
        The new tokens are checked one by one; one that ends the request drops those after it (a step
        that accepted draft tokens can overshoot a stop). `logprobs`: by request id, each new token's
        log-probabilities (None where not asked for). `finish(request, reason)` ends a request (the
        scheduler's `finish_request`)."""
        outputs = []
        for request, num_new, previous_token_time in updated:
            first = len(request.output_token_ids) - num_new
            new_logprobs = [lp for lp in logprobs.get(request.request_id, ()) if lp is not None]
            request.output_logprobs.extend(new_logprobs)
            detokenizer = self._detokenizers[request.request_id]
            reason = None
            for num_output in range(first + 1, first + num_new + 1):
                reason = stop_reason(request, num_output, self.max_model_len)
                grammar_reason = self._advance_grammar(request, num_output)
                stopped = detokenizer.update([request.output_token_ids[num_output - 1]])
                reason = reason or grammar_reason or (FinishReason.STOP if stopped else None)
                if reason is not None:
                    request.truncate_output(num_output)
                    break
            new_ids = request.output_token_ids[first:]
            if self.observer is not None:
                self.observer.on_new_tokens(
                    request, len(new_ids), request.last_token_time, previous_token_time
                )
            if reason is not None:
                finish(request, reason)
            outputs.append(self._output(request, new_ids, new_logprobs[: len(new_ids)]))
        return outputs

    def final_output(self, request: Request) -> RequestOutput:
        """The last output of a request that has just finished outside a step (an abort)."""
        return self._output(request, [], [])

    def _advance_grammar(self, request: Request, num_output: int) -> FinishReason | None:
        """Feed output token `num_output` (1-based) to the request's grammar: `STOP` once the grammar has
        ended; `ABORT` when
        it refused the token. A grammar that allowed no token at all (a constraint no output can
        complete, such as the regex `a[^\\s\\S]`) also sets `request.error`, which the API answers as a
        400; any other refusal is a bug (the bitmask allowed only tokens the grammar accepts)."""
        if request.grammar is None:
            return None
        token_id = request.output_token_ids[num_output - 1]
        if request.grammar.accept_token(token_id):
            return FinishReason.STOP if request.grammar.is_terminated() else None
        if not self.structured_output.allows_a_token(request.grammar):
            so = request.sampling_params.structured_output
            done = self.tokenizer.decode(request.output_token_ids[: num_output - 1])
            request.error = (
                f"{so.param}: no token of this model continues the constraint after {done!r}: "
                "no output matches it"
            )
        else:
            logger.error("request %s: grammar refused sampled token %d", request.request_id, token_id)
        return FinishReason.ABORT

    def _output(self, request: Request, new_ids: list[int], new_logprobs: list[Logprob]) -> RequestOutput:
        finished = request.is_finished
        if finished:
            detok = self._detokenizers.pop(request.request_id, None)
            if self.observer is not None:
                self.observer.on_finished(request)
        else:
            detok = self._detokenizers[request.request_id]
        return RequestOutput(
            request.request_id,
            new_ids,
            detok.delta(finished=finished) if detok else "",
            new_logprobs,
            finished,
            request.finish_reason if finished else None,
            request.num_prompt_tokens,
            len(request.output_token_ids),
            request.num_cached_tokens,
            request.error if finished else None,
        )
