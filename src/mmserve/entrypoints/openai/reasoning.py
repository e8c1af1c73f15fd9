"""A reasoning model's thinking apart from its answer: vLLM's `--reasoning-parser` (`qwen3`,
`deepseek_r1`), chat's `reasoning_content`.

Qwen3-VL-Thinking (and DeepSeek-R1-style models) write `<think>` thinking `</think>` then the
answer; a Thinking model's chat template opens the block itself (the prompt ends in `<think>\n`),
a hybrid one the model opens, and with thinking switched off (`chat_template_kwargs:
{"enable_thinking": false}`) the template closes an empty block so the output is all answer. One
rule covers the three: the output starts inside thinking when the prompt's last `<think>` is not
closed; else it does when the output opens with `<think>`; thinking ends at `</think>` (the
newlines after it dropped), and an output cut off before `</think>` is all thinking.

`ReasoningSplitter` applies it as text streams, holding back what may be the start of a tag; the
whole answer goes through the same splitter, so a stream's pieces join to the whole answer's.
"""

from __future__ import annotations

THINK, END = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek_r1")  # vLLM's names; both follow the rule above


def opens_thinking(prompt: str) -> bool:
    """Whether `prompt` ends inside a thinking block its template opened."""
    return prompt.rfind(THINK) > prompt.rfind(END)


def _partial_tail(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (a tag split across deltas)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningSplitter:
    """One choice's text as (thinking, answer) pieces: `feed` each new piece of text, `finish`
    once at its end. `reasoned`: whether the choice thought at all (its `reasoning_content` is
    None otherwise)."""

    def __init__(self, prompt: str) -> None:
        self.state = "thinking" if opens_thinking(prompt) else "start"  # start | thinking | after | answer
        self.reasoned = self.state == "thinking"
        self._held = ""  # text that may begin a tag (or, at the start, only whitespace so far)

    def feed(self, text: str) -> tuple[str, str]:
        text, self._held = self._held + text, ""
        thinking = answer = ""
        while text:
            if self.state == "start":
                stripped = text.lstrip()
                if stripped.startswith(THINK):
                    self.state, self.reasoned, text = "thinking", True, stripped[len(THINK):]
                elif not stripped or THINK.startswith(stripped):
                    self._held, text = text, ""
                else:
                    self.state = "answer"
            elif self.state == "thinking":
                end = text.find(END)
                if end >= 0:
                    thinking, text, self.state = thinking + text[:end], text[end + len(END):], "after"
                else:
                    keep = _partial_tail(text, END)
                    thinking, self._held, text = thinking + text[:len(text) - keep], text[len(text) - keep:], ""
            elif self.state == "after":
                text = text.lstrip("\n")
                self.state = "answer" if text else "after"
            else:
                answer, text = answer + text, ""
        return thinking, answer

    def finish(self) -> tuple[str, str]:
        """What was held back: thinking cut off inside a tag's first characters, or answer."""
        held, self._held = self._held, ""
        return (held, "") if self.state == "thinking" else ("", held)

    def step(self, text: str, last: bool) -> tuple[str, str]:
        """A streamed delta's (thinking, answer): `feed`, and at the `last` delta `finish` too."""
        thinking, answer = self.feed(text)
        if last:
            rest_thinking, rest_answer = self.finish()
            thinking, answer = thinking + rest_thinking, answer + rest_answer
        return thinking, answer

    def split(self, text: str) -> tuple[str | None, str]:
        """A whole answer's (thinking, or None if it did not think; answer)."""
        thinking, answer = self.step(text, True)
        return (thinking if self.reasoned else None), answer
