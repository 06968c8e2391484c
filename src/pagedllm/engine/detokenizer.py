"""Incremental detokenization with stop strings."""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from pagedllm.sampling_params import SamplingParams

# Prompt tokens fed to the stream as context (like vLLM): decoders such as Metaspace strip the
# leading space of the first token they see, which would eat the space of the first output token.
_MIN_PROMPT_CONTEXT = 4
_MAX_PROMPT_CONTEXT = 24


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop: list[str] = list(params.stop or [])
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self._stream = DecodeStream(
            ids=self._prompt_context(prompt_token_ids), skip_special_tokens=self.skip_special_tokens
        )
        self._text = ""
        self._num_tokens = 0
        self._pending: list[int] = []  # fed tokens the stream has not turned into text yet
        self._stop_str: str | None = None  # set once a stop string matched; text is final
        self._sent = 0  # chars already handed out by get_next_output_text(delta=True)

    @property
    def output_text(self) -> str:
        return self._text

    @property
    def num_tokens(self) -> int:
        """Output tokens fed so far."""
        return self._num_tokens

    def _prompt_context(self, prompt_token_ids: list[int]) -> list[int]:
        # The shortest tail (of at least a few tokens) that decodes cleanly: one starting or
        # ending inside a multi-byte character would make the stream emit prompt text.
        n = len(prompt_token_ids)
        for i in range(min(_MIN_PROMPT_CONTEXT, n), min(_MAX_PROMPT_CONTEXT, n) + 1):
            tail = prompt_token_ids[n - i :]
            if "\ufffd" not in self.tokenizer.decode(tail, self.skip_special_tokens):
                return tail
        return []

    def _step(self, token_id: int) -> str | None:
        try:
            return self._stream.step(self.tokenizer, token_id)
        except Exception:
            # DecodeStream raises "Invalid prefix" when a decoder rewrites earlier text (e.g. a
            # cleanup rule); restart it from this token rather than failing the request.
            self._stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
            return self._stream.step(self.tokenizer, token_id)

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> str | None:
        """Append the text of `new_token_ids`; return the stop string that matched, if any.

        `stop_terminated`: the last token is an EOS/stop token that ended the request; its text
        is left out unless include_stop_str_in_output (as vLLM does).
        """
        if self._stop_str is not None:
            return None  # already stopped: the text is final
        self._num_tokens += len(new_token_ids)
        if stop_terminated and not self.include_stop_str_in_output:
            new_token_ids = new_token_ids[:-1]
        pieces = []
        for token_id in new_token_ids:
            piece = self._step(token_id)
            if piece is None:
                self._pending.append(token_id)
            else:
                self._pending.clear()
                pieces.append(piece)
        check_from = len(self._text)
        self._text += "".join(pieces)
        # Like vLLM, stop strings only count once min_tokens tokens have been generated.
        if self.stop and self._num_tokens > self.min_tokens and len(self._text) > check_from:
            return self._check_stop(check_from)
        return None

    def _check_stop(self, check_from: int) -> str | None:
        # Older text held no match, so a match must end in the new text: search only from
        # len(stop) - 1 chars before it. The earliest match wins.
        best: tuple[int, str] | None = None
        for stop in self.stop:
            index = self._text.find(stop, max(0, check_from - len(stop) + 1))
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        end = index + len(stop) if self.include_stop_str_in_output else index
        self._text = self._text[:end]
        self._stop_str = stop
        self._pending.clear()
        return stop

    def _held_back(self) -> int:
        """Length of the longest tail of the text that could still grow into a stop string."""
        if self._stop_str is not None or not self.stop:
            return 0
        text = self._text
        for n in range(min(len(text), max(map(len, self.stop)) - 1), 0, -1):
            tail = text[-n:]
            if any(stop.startswith(tail) for stop in self.stop):
                return n
        return 0

    def mark_sent(self, num_chars: int) -> None:
        """The first `num_chars` characters were handed out already (by a lost engine)."""
        self._sent = min(num_chars, len(self._text))

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text since the last call (delta) or all of it, minus any held-back tail."""
        if finished and self._pending and self._stop_str is None:
            # Tokens that never completed a character (output cut mid-character): emit them
            # as decode() would, with replacement characters.
            self._text += self.tokenizer.decode(self._pending, self.skip_special_tokens)
            self._pending.clear()
        end = len(self._text) if finished else len(self._text) - self._held_back()
        end = max(end, self._sent)
        start = self._sent if delta else 0
        self._sent = end
        return self._text[start:end]
