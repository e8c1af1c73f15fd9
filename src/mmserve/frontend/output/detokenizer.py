"""Incremental detokenizing of one request's output, with stop strings and streaming deltas."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmserve.frontend.output.stop_matcher import StopMatcher
from mmserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's output token ids into text as they arrive.

    Decoding uses vLLM's two offsets into `token_ids`: text is emitted for
    `token_ids[read_offset:]` by decoding `token_ids[prefix_offset:]` and dropping the text of
    `token_ids[prefix_offset:read_offset]`, so a decoder that depends on the previous token
    (e.g. SentencePiece dropping a leading space) sees its context. New text that ends in
    U+FFFD is held back (with its tokens) because the last token may have split a UTF-8
    character; `update(..., finished=True)` decodes what is held as `tokenizer.decode` would.

    Invariants: `output_text` only grows until a stop string matches (then it is truncated
    once and never changes again); before any stop, `output_text` is a prefix of
    `tokenizer.decode(token_ids, skip_special_tokens=...)` and equal to it after a finished
    update. Text given out by `take_delta` is never taken back: a tail that could still start a
    stop string is held back unless `include_stop_str_in_output` is set, since then a match
    truncates only after the stop string. `clean_up_tokenization_spaces` is not applied (it
    is not prefix-stable). Stop strings are matched incrementally (`stop_matcher.py`): the cost
    of a token's text does not grow with their number.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerFast, params: SamplingParams) -> None:
        self._backend = tokenizer.backend_tokenizer
        self._skip_special_tokens = params.skip_special_tokens
        self._stops = StopMatcher(tuple(params.stop)) if params.stop else None
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens  # stop strings count only after this many tokens (vLLM)
        self.token_ids: list[int] = []
        self.output_text = ""
        self.stop_str: str | None = None  # the stop string that ended the output, if any
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text = ""  # decode(token_ids[prefix_offset:read_offset])
        self._sent = 0  # characters of output_text already returned by take_delta

    @property
    def stopped(self) -> bool:
        """True once a stop string matched; later updates are ignored."""
        return self.stop_str is not None

    def update(self, new_token_ids: list[int], finished: bool = False) -> str | None:
        """Append the text of `new_token_ids`; return the stop string if one now matched.

        Pass `finished=True` with the request's last tokens so that bytes of an incomplete
        character are decoded (as U+FFFD) instead of held. After a match `output_text` is cut
        before the stop string (after it with `include_stop_str_in_output`).
        """
        if self.stop_str is not None:
            return None
        self.token_ids.extend(new_token_ids)
        new_text = self._decode_new(flush=finished)
        if not new_text:
            return None
        start = len(self.output_text)
        self.output_text += new_text
        if self._stops is None:
            return None
        match = self._stops.feed(new_text, start, report=len(self.token_ids) > self._min_tokens)
        return None if match is None else self._truncate(*match)

    def take_delta(self, finished: bool = False) -> str:
        """Return the text not returned yet, holding back a possible stop-string start.

        With `finished=True` (or after a stop matched) everything left is returned.
        """
        end = len(self.output_text)
        if not finished and self.stop_str is None and not self._include_stop:
            end -= self._partial_stop_length()
        end = max(end, self._sent)
        delta = self.output_text[self._sent:end]
        self._sent = end
        return delta

    def _decode_new(self, flush: bool) -> str:
        """Decode tokens past read_offset; advance the offsets when the text is complete."""
        text = self._decode(self.token_ids[self._prefix_offset:])
        if len(text) <= len(self._prefix_text):
            return ""
        if text.endswith(_REPLACEMENT_CHAR) and not flush:
            return ""
        new_text = text[len(self._prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        self._prefix_text = self._decode(self.token_ids[self._prefix_offset:self._read_offset])
        return new_text

    def _decode(self, token_ids: list[int]) -> str:
        return self._backend.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _truncate(self, begin: int, end: int) -> str:
        """End the output at the stop string `output_text[begin:end]`; return it."""
        stop = self.output_text[begin:end]
        self.output_text = self.output_text[:end if self._include_stop else begin]
        self._sent = min(self._sent, len(self.output_text))
        self.stop_str = stop
        return stop

    def _partial_stop_length(self) -> int:
        """Length of the longest tail of output_text that is a proper prefix of a stop string."""
        return 0 if self._stops is None else self._stops.pending
