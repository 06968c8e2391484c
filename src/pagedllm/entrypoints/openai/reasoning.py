"""Reasoning parsers (`--reasoning-parser`, vLLM's names): a reasoning model's `<think> ...
</think>` text goes to `reasoning_content`, the rest to `content`, in whole answers and in
streamed deltas (the tags may arrive split across chunks).

- `deepseek_r1`: the reasoning runs from the start (or from `<think>`, which the template often
  writes into the prompt instead) to `</think>`; without `</think>` the whole text is reasoning
  (the answer was cut off while thinking).
- `qwen3`: reasoning only inside `<think> ... </think>` at the start of the text; an answer
  without it (thinking disabled) is all content.
"""

from __future__ import annotations

START, END = "<think>", "</think>"
REASONING_PARSERS = ("deepseek_r1", "qwen3")


def split_reasoning(parser: str, text: str) -> tuple[str | None, str | None]:
    """A whole answer -> (reasoning_content, content); None for an empty part."""
    reasoning, content = ReasoningStream(parser).feed(text, last=True)
    return reasoning or None, content or None


class ReasoningStream:
    """One choice's text, delta by delta -> (reasoning delta, content delta)."""

    def __init__(self, parser: str) -> None:
        if parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}; known: {REASONING_PARSERS}")
        self.parser = parser
        # "start": nothing decided yet; "thinking": inside the reasoning; "content": after it
        self.state = "start" if parser == "qwen3" else "thinking"
        self.pending = ""  # text held back: it may be the start of a tag
        self.opened = False  # reasoning text has begun (a <think> after it is text)

    def feed(self, text: str, last: bool = False) -> tuple[str, str]:
        """The next delta's parts; `last`: the text is complete, nothing is held back."""
        reasoning, content = self._feed(text)
        if last:
            held, self.pending = self.pending, ""
            if self.state == "thinking":  # a tag that never came is text
                reasoning += held
            else:
                content += held
        return reasoning, content

    def _feed(self, text: str) -> tuple[str, str]:
        reasoning, content = "", ""
        text = self.pending + text
        self.pending = ""
        while text:
            if self.state == "start":  # qwen3: the answer opens with <think>, or has none
                stripped = text.lstrip()
                if stripped.startswith(START):
                    self.state, text = "thinking", stripped[len(START) :]
                    self.opened = True
                elif START.startswith(stripped):  # perhaps <think>, not all here yet
                    self.pending = text
                    return reasoning, content
                else:
                    self.state = "content"
            elif self.state == "thinking":
                if not self.opened:  # deepseek_r1: <think> may open the text, or not
                    if text.startswith(START):
                        text = text[len(START) :]
                        self.opened = True
                        continue
                    if START.startswith(text):
                        self.pending = text
                        return reasoning, content
                    self.opened = True
                end = text.find(END)
                if end >= 0:
                    reasoning += text[:end]
                    self.state, text = "content", text[end + len(END) :]
                    continue
                keep = _partial_tag(text, END)
                reasoning += text[: len(text) - keep]
                self.pending = text[len(text) - keep :]
                return reasoning, content
            else:
                content += text
                text = ""
        return reasoning, content


def _partial_tag(text: str, tag: str) -> int:
    """How many of text's last characters could begin `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
