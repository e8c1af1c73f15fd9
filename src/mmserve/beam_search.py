"""Beam search, as vLLM runs it: in the frontend, one engine request per beam and step.

Each step asks the engine for one token of every live beam (the prompt with the beam's tokens
after it, `Prompt.continuation`) with the log probabilities of its 2 x `beam_width` most likely
next tokens. Every beam's candidates are scored and the best `beam_width` that did not end go on;
a candidate that ends (an EOS id, unless `ignore_eos`) is kept aside. After `max_tokens` steps, or
when no beam is left, the best `beam_width` of the ended and the live are the answer.

The beams share the prompt's KV blocks and its images' encoder outputs through the caches, so a
step computes about one token per beam (full and partial prefix blocks). A candidate's score is vLLM's
`cumulative log probability / length ** length_penalty`, the length counting the prompt's tokens
and the beam's, an ending EOS not counted.

Log probabilities are the model's own (the step is greedy, so nothing scales them): as vLLM's raw
log probabilities, a request's temperature changes nothing here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, AsyncGenerator, Callable, Sequence

from mmserve.frontend.request.prompt import Prompt
from mmserve.outputs import CompletionOutput, RequestOutput
from mmserve.sampling_params import BeamSearchParams

Decode = Callable[[list[int]], str]


@dataclass
class Beam:
    token_ids: list[int]
    cum_logprob: float = 0.0
    ended: bool = False  # by an EOS id

    @property
    def shown(self) -> list[int]:
        """The tokens its text shows (an ending EOS not)."""
        return self.token_ids[:-1] if self.ended else self.token_ids

    @property
    def finish_reason(self) -> str:
        return "stop" if self.ended else "length"


@dataclass
class BeamSearch:
    """One prompt's search: its live beams and those that ended."""

    prompt: Prompt
    params: BeamSearchParams
    eos_token_ids: frozenset[int]
    beams: list[Beam] = field(default_factory=lambda: [Beam([])])
    ended: list[Beam] = field(default_factory=list)
    steps: int = 0
    max_model_len: int | None = None  # a beam stops there, as a request does ("length")
    prompt_token_ids: list[int] | None = None
    num_cached_tokens: int | None = None

    @property
    def done(self) -> bool:
        room = None if self.max_model_len is None or self.prompt_token_ids is None else \
            self.max_model_len - len(self.prompt_token_ids)
        return not self.beams or self.steps >= self.params.max_tokens or (room is not None and self.steps >= room)

    def step_prompts(self) -> list[Prompt]:
        """The live beams' prompts: the prompt with each beam's tokens after it."""
        return [dataclasses.replace(self.prompt, continuation=tuple(b.token_ids)) for b in self.beams]

    def advance(self, outputs: Sequence[RequestOutput]) -> None:
        """Take the step's outputs (one per live beam, in `step_prompts`' order)."""
        if self.prompt_token_ids is None:
            first = outputs[0]
            self.prompt_token_ids = first.prompt_token_ids[:len(first.prompt_token_ids) - len(self.beams[0].token_ids)]
            self.num_cached_tokens = first.num_cached_tokens
        candidates: list[Beam] = []
        for beam, out in zip(self.beams, outputs):
            for token_id, entry in (out.outputs[0].logprobs or [{}])[0].items():
                ends = token_id in self.eos_token_ids and not self.params.ignore_eos
                candidates.append(Beam(beam.token_ids + [token_id], beam.cum_logprob + entry.logprob, ends))
        candidates.sort(key=self.score, reverse=True)
        self.ended += [c for c in candidates if c.ended]
        self.beams = [c for c in candidates if not c.ended][:self.params.beam_width]
        self.steps += 1

    def score(self, beam: Beam) -> float:
        """vLLM's `get_beam_search_score`: the prompt's tokens and the beam's, an ending EOS not counted."""
        length = len(self.prompt_token_ids or ()) + len(beam.token_ids) - (1 if beam.ended else 0)
        return beam.cum_logprob / (length ** self.params.length_penalty)

    def best(self) -> list[Beam]:
        return sorted(self.ended + self.beams, key=self.score, reverse=True)[:self.params.beam_width]

    def output(self, request_id: str, decode: Decode) -> RequestOutput:
        """The answer: the best beams as completions, best first (`decode(token_ids)` their text)."""
        completions = []
        for i, beam in enumerate(self.best()):
            completions.append(CompletionOutput(
                i, decode(beam.shown), beam.token_ids, finish_reason=beam.finish_reason,
                stop_reason=beam.token_ids[-1] if beam.ended else None, num_cached_tokens=self.num_cached_tokens))
        return RequestOutput(request_id, self.prompt.shown_text, list(self.prompt_token_ids or ()), completions,
                             finished=True, num_cached_tokens=self.num_cached_tokens)


@dataclass
class BeamSearchSequence:
    """vLLM's: `tokens` the prompt's and the beam's; `text` the beam's alone (vLLM's offline API
    decodes the prompt's too)."""

    tokens: list[int]
    cum_logprob: float
    text: str
    finish_reason: str  # "stop" (an EOS id, its text not shown) or "length"


@dataclass
class BeamSearchOutput:
    """vLLM's: one prompt's best beams, best first."""

    sequences: list[BeamSearchSequence]


def sequences_of(search: BeamSearch, decode: Decode) -> BeamSearchOutput:
    """vLLM's offline shape of `search.output`: the same beams, in the same order."""
    prompt = list(search.prompt_token_ids or ())
    return BeamSearchOutput([BeamSearchSequence(prompt + beam.token_ids, beam.cum_logprob, decode(beam.shown),
                                                beam.finish_reason) for beam in search.best()])


def run(searches: list[BeamSearch], step: Callable[[list[Prompt]], list[RequestOutput]]) -> None:
    """Every search to its end; each round one `step` over all their live beams (one batch)."""
    while live := [s for s in searches if not s.done]:
        outputs = step([p for s in live for p in s.step_prompts()])
        at = 0
        for s in live:
            n = len(s.beams)
            s.advance(outputs[at:at + n])
            at += n


async def serve(engine: Any, request_id: str, prompt: Prompt, params: BeamSearchParams,
                **routing: Any) -> AsyncGenerator[RequestOutput, None]:
    """The server's beam search over an `AsyncLLM`: each step's beams as concurrent requests
    (`{request_id}-{step}-{beam}`, placed and ordered by `routing`), the answer as one last output.
    A failed beam request fails the search and cancels the step's others; so does the caller leaving."""
    inputs = engine.input_processor
    search = BeamSearch(prompt, params, inputs.eos_token_ids, max_model_len=inputs.max_model_len)
    step_params = params.step_params()

    async def last(rid: str, beam: Prompt) -> RequestOutput:
        outputs = [out async for out in engine.generate(rid, beam, step_params, **{**routing, "stream": False})]
        return outputs[-1]

    while not search.done:
        tasks = [asyncio.ensure_future(last(f"{request_id}-{search.steps}-{i}", p))
                 for i, p in enumerate(search.step_prompts())]
        try:
            outputs = await asyncio.gather(*tasks)
        except BaseException:  # the first beam's error, as a request's own (a 400, a 503): the others end
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        search.advance(outputs)
    yield search.output(request_id, functools.partial(inputs.tokenizer.decode, skip_special_tokens=True))
