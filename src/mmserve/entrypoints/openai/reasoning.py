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

A structured answer (`response_format`, a forced tool call) binds after the thinking when both tags
are single tokens of the tokenizer (`thinking_token_ids`, as Qwen3's and DeepSeek-R1's are): the
grammar starts after `</think>` (the runner's `RequestGrammar`) and the thinking is split off as
for a free answer. With tags that are not single tokens the grammar binds from the first token and
nothing is split, as before a reasoning parser.
"""

from __future__ import annotations

from typing import Any

THINK, END = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek_r1")  # vLLM's names; both follow the rule above


def thinking_token_ids(tokenizer: Any) -> tuple[int, int] | None:
    """The ids of `<think>` and `</think>` when each is one token of `tokenizer`, else None."""
    if tokenizer is None:
        return None
    ids = []
    for tag in (THINK, END):
        encoded = tokenizer.encode(tag, add_special_tokens=False)
        if len(encoded) != 1 or tokenizer.convert_ids_to_tokens(encoded[0]) != tag:
            return None
        ids.append(encoded[0])
    return ids[0], ids[1]


def opens_thinking(prompt: str) -> bool:
    """Whether `prompt` ends inside a thinking block its template opened."""
    return prompt.rfind(THINK) > prompt.rfind(END)


def thinking_tokens(token_ids: list[int], reasoned: bool, end_id: int | None) -> int:
    """How many of a choice's `token_ids` are its thinking (the Responses API's `reasoning_tokens`):
    up to and with `</think>` (`end_id`), all of them if it never closed; 0 if it did not think,
    or if `</think>` is not one token (the split is then the text's alone)."""
    if not reasoned or end_id is None:
        return 0
    return token_ids.index(end_id) + 1 if end_id in token_ids else len(token_ids)


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
