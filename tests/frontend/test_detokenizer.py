"""Tests for incremental detokenizing: equality with `decode`, stop strings, streaming deltas."""

from __future__ import annotations

import functools

from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from mmserve.frontend.output.detokenizer import IncrementalDetokenizer
from mmserve.sampling_params import SamplingParams

CORPUS = ["hello world, the café is open", "日本語 を 話します 🙂 🙂", "naïve façade über straße",
          "the quick brown fox jumps over the lazy dog", "END of story STOP here"]
ALPHABET = "abc hello wod,ENDSTOP café日本語🙂üß\n"


@functools.lru_cache(maxsize=1)
def tokenizer() -> PreTrainedTokenizerFast:
    """A tiny byte-level BPE: merges split multi-byte characters across tokens."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(CORPUS * 3, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                   clean_up_tokenization_spaces=False)
    fast.add_tokens(["<extra>"])
    return fast


def test_tokenizer_splits_characters_across_tokens() -> None:
    """Guards the property tests: some tokens must hold only part of a UTF-8 character."""
    assert any("\ufffd" in tokenizer().decode([i]) for i in encode("日本語 🙂"))


def encode(text: str) -> list[int]:
    return tokenizer().encode(text, add_special_tokens=False)


def run(ids: list[int], chunks: list[int], params: SamplingParams) -> tuple[IncrementalDetokenizer, list[str]]:
    """Feed `ids` in chunks of the given sizes (cycled), taking a delta after each update."""
    detok = IncrementalDetokenizer(tokenizer(), params)
    deltas, position, step = [], 0, 0
    while position < len(ids):
        size = chunks[step % len(chunks)] if chunks else 1
        batch, position, step = ids[position:position + size], position + size, step + 1
        detok.update(batch, finished=position >= len(ids))
        deltas.append(detok.take_delta())
        if detok.stopped:
            break
    deltas.append(detok.take_delta(finished=True))
    return detok, deltas


token_ids = st.lists(st.integers(0, len(tokenizer()) - 1), max_size=40)
chunk_sizes = st.lists(st.integers(1, 4), max_size=5)


@settings(max_examples=300, deadline=None)
@given(ids=token_ids, chunks=chunk_sizes, skip=st.booleans())
def test_matches_decode_for_random_ids(ids: list[int], chunks: list[int], skip: bool) -> None:
    params = SamplingParams(skip_special_tokens=skip)
    reference = tokenizer().decode(ids, skip_special_tokens=skip)
    detok = IncrementalDetokenizer(tokenizer(), params)
    for i, token in enumerate(ids):
        detok.update([token])
        assert reference.startswith(detok.output_text)
        assert tokenizer().decode(ids[:i + 1], skip_special_tokens=skip).startswith(detok.output_text)
    detok.update([], finished=True)
    assert detok.output_text == reference
    _, deltas = run(ids, chunks, params)
    assert "".join(deltas) == reference


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=ALPHABET, max_size=40), chunks=chunk_sizes)
def test_matches_decode_for_real_text(text: str, chunks: list[int]) -> None:
    ids = encode(text)
    detok, deltas = run(ids, chunks, SamplingParams())
    assert detok.output_text == text == "".join(deltas)


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet=ALPHABET, max_size=40), chunks=chunk_sizes, include=st.booleans(),
       stops=st.lists(st.text(alphabet="abcdEND 🙂日", min_size=1, max_size=4), min_size=1, max_size=3))
def test_stop_strings(text: str, chunks: list[int], include: bool, stops: list[str]) -> None:
    params = SamplingParams(stop=stops, include_stop_str_in_output=include)
    detok, deltas = run(encode(text), chunks, params)
    assert "".join(deltas) == detok.output_text
    if detok.stop_str is None:
        assert detok.output_text == text and not any(stop in text for stop in stops)
        return
    before = detok.output_text[:-len(detok.stop_str)] if include else detok.output_text
    assert text.startswith(before + detok.stop_str)
    assert not any(stop in before for stop in stops)
    assert detok.output_text == (before + detok.stop_str if include else before)


def test_stop_string_spanning_two_tokens() -> None:
    ids = encode("hello wor") + encode("ld and more")
    detok = IncrementalDetokenizer(tokenizer(), SamplingParams(stop=["world"]))
    assert detok.update(encode("hello wor")) is None
    assert detok.take_delta() == "hello "  # "wor" could start "world"
    assert detok.update(encode("ld and more")) == "world"
    assert detok.output_text == "hello " and detok.take_delta() == ""
    assert detok.update(encode(" ignored")) is None and detok.output_text == "hello "
    assert ids[:len(detok.token_ids)] == detok.token_ids


def test_stop_string_at_the_very_start() -> None:
    detok = IncrementalDetokenizer(tokenizer(), SamplingParams(stop=["STOP"]))
    assert detok.update(encode("STOP here")) == "STOP"
    assert detok.output_text == "" and detok.take_delta() == ""


def test_include_stop_str_in_output() -> None:
    params = SamplingParams(stop=["END", "fox"], include_stop_str_in_output=True)
    detok = IncrementalDetokenizer(tokenizer(), params)
    detok.update(encode("the E"))
    assert detok.take_delta() == "the E"  # nothing is held back: a match cuts after the stop
    assert detok.update(encode("ND of the fox")) == "END"
    assert detok.output_text == "the END" and detok.take_delta() == "ND"


def test_earliest_stop_wins_within_one_update() -> None:
    detok = IncrementalDetokenizer(tokenizer(), SamplingParams(stop=["fox", "quick"]))
    assert detok.update(encode("the quick brown fox")) == "quick"
    assert detok.output_text == "the "


def test_stop_on_a_character_split_across_tokens() -> None:
    ids = encode("a") + [i for byte in "🙂".encode() for i in encode_byte(byte)] + encode("b")
    detok = IncrementalDetokenizer(tokenizer(), SamplingParams(stop=["🙂"]))
    stops = [detok.update([token]) for token in ids]
    assert stops == [None, None, None, None, "🙂", None]
    assert detok.output_text == "a"


def encode_byte(byte: int) -> list[int]:
    """The id of the single-byte token for `byte` (byte-level BPE has all 256)."""
    token_id = tokenizer().convert_tokens_to_ids(_byte_to_unicode()[byte])
    assert isinstance(token_id, int)
    return [token_id]


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-to-printable-character map that ByteLevel uses."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return chars


def test_special_tokens_skipped_or_kept() -> None:
    ids = [tokenizer().bos_token_id] + encode("hi") + [tokenizer().eos_token_id]
    for skip, expected in [(True, "hi"), (False, "<s>hi</s>")]:
        detok, deltas = run(ids, [1], SamplingParams(skip_special_tokens=skip))
        assert detok.output_text == expected == "".join(deltas)


def test_unfinished_partial_character_is_held_then_flushed() -> None:
    first_byte = encode_byte("日".encode()[0])
    detok = IncrementalDetokenizer(tokenizer(), SamplingParams())
    detok.update(encode("ok"))
    detok.update(first_byte)
    assert detok.output_text == "ok" and detok.take_delta() == "ok"
    detok.update([], finished=True)
    assert detok.take_delta() == "\ufffd"
    assert detok.output_text == "ok\ufffd" == tokenizer().decode(encode("ok") + first_byte)
