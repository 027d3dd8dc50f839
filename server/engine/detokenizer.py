"""Incremental detokenization with stop strings.

Text is produced as vLLM's `detokenize_incrementally` does it: decode a short window of recent tokens
and emit only what that window adds, holding back while the text ends in U+FFFD (a UTF-8 character
split across tokens). Stop strings end generation; the text never includes them (unless asked) and the
stream never sends any prefix of one, because a tail that could still grow into a stop string is held
back until it cannot.
"""

from __future__ import annotations

from conveyor.server.messages import SamplingParams

# Prompt tokens decoded with the first output tokens, so tokenizers that drop a word's leading space
# when it starts the text (SentencePiece) still produce it.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Per-request text state. `output_text` is the text so far (stop string removed once hit)."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in params.stop if s]
        self.min_tokens = params.min_tokens
        self.num_output = 0
        self.include_stop = params.include_stop_str_in_output
        self.token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.output_text = ""
        self.num_sent = 0
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def update(self, new_token_ids: list[int]) -> bool:
        """Add output tokens; returns True when a stop string was found (the text is then final). Stop
        strings count only in text that comes after `min_tokens` output tokens (vLLM's rule: the first
        `min_tokens` tokens may contain them)."""
        for token_id in new_token_ids:
            if self.stopped:
                break
            self.token_ids.append(token_id)
            self.num_output += 1
            prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
            text = self._decode(self.token_ids[self.prefix_offset :])
            if len(text) <= len(prefix) or text.endswith("\ufffd"):
                continue
            before = len(self.output_text)
            self.output_text += text[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            if self.num_output > self.min_tokens:
                self._check_stop(before)
        return self.stopped

    def _check_stop(self, old_len: int) -> None:
        for stop in self.stop:
            start = max(0, old_len - len(stop) + 1)
            idx = self.output_text.find(stop, start)
            if idx != -1:
                self.output_text = self.output_text[: idx + len(stop) if self.include_stop else idx]
                self.stopped = True
                return

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        text = self.output_text
        longest = 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def delta(self, finished: bool) -> str:
        """Text not yet sent that is safe to send; everything left once `finished`."""
        end = len(self.output_text) if finished or self.stopped else len(self.output_text) - self._held_back()
        if end <= self.num_sent:
            return ""
        out = self.output_text[self.num_sent : end]
        self.num_sent = end
        return out
