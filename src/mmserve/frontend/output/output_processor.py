"""P0's output processing: engine-core token outputs -> detokenized `RequestOutput`s.

Stop strings are found here, while detokenizing; such completions are finished here and
returned in `OutputBatch.to_abort` so the engine core frees them (a completion of an n > 1
request by its `sibling_request_id`, plus the request's own id once its last completion ends).
A request with `n` completions has one state per completion; it is finished when all are, and
each batch yields at most one `RequestOutput` per request, holding every completion.
"""

from __future__ import annotations

import dataclasses
from collections.abc import MutableMapping
from dataclasses import dataclass, field

from mmserve.cache_report import CacheReport
from mmserve.frontend.output.detokenizer import IncrementalDetokenizer
from mmserve.ipc.messages import EngineCoreOutput, EngineCoreRequest, FinishReason, TokenLogprobs, sibling_request_id
from mmserve.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput, RequestTimes, SampleLogprobs


@dataclass
class CompletionState:
    index: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int | None = None

    def to_output(self) -> CompletionOutput:
        delta = self.detokenizer.take_delta(finished=self.finish_reason is not None)
        return CompletionOutput(self.index, self.detokenizer.output_text, list(self.token_ids), self.finish_reason,
                                self.stop_reason, delta, None if self.logprobs is None else list(self.logprobs),
                                self.num_cached_tokens)


@dataclass
class RequestState:
    request: EngineCoreRequest
    prompt: str | None
    completions: list[CompletionState]
    num_cached_tokens: int | None = None  # from the first engine-core output of completion 0
    report: CacheReport | None = None  # P0's layers counted at admission; P1's merged from completion 0
    prompt_logprobs: PromptLogprobs | None = None  # from completion 0's first output, when asked
    times: RequestTimes | None = None  # P1's, from its first output with tokens on (any completion's)
    hidden: bytes | None = None  # an embedding request's: its prompt's last hidden state, from its first output

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)

    def to_output(self) -> RequestOutput:
        return RequestOutput(self.request.request_id, self.prompt, self.request.prompt_token_ids,
                             [c.to_output() for c in self.completions], self.finished, self.num_cached_tokens,
                             self.report, self.prompt_logprobs,
                             None if self.times is None else dataclasses.replace(self.times), self.hidden)

    def timed(self, out: EngineCoreOutput) -> None:
        """Take `out`'s P1 times: queued and scheduled from a completion's first output, the token times."""
        if not out.new_token_ids:
            return
        if self.times is None:
            queued = out.queued_at if out.queued_at is not None else out.timestamp
            self.times = RequestTimes(queued, out.scheduled_at, out.timestamp, out.timestamp)
        self.times.last_token_ts = max(self.times.last_token_ts, out.timestamp)


@dataclass
class OutputBatch:
    outputs: list[RequestOutput]
    to_abort: list[str]


class OutputProcessor:
    """Engine-core outputs -> `RequestOutput`s, over a table of each request's `RequestState`.

    `states` is that table: its own by default; `AsyncLLM`'s keeps each state on its open request
    (`open_requests.py: OutputStates`), so a request's output state has one owner."""

    def __init__(self, tokenizer, states: MutableMapping[str, RequestState] | None = None) -> None:
        self.tokenizer = tokenizer
        self.states: MutableMapping[str, RequestState] = {} if states is None else states
        self._texts: dict[int, str] = {}  # token id -> its text alone (`_token_text`)

    def add_request(self, request: EngineCoreRequest, prompt: str | None, report: CacheReport | None = None) -> None:
        params = request.sampling_params
        completions = [CompletionState(i, IncrementalDetokenizer(self.tokenizer, params),
                                       logprobs=None if params.logprobs is None else [])
                       for i in range(params.n)]
        self.states[request.request_id] = RequestState(request, prompt, completions, report=report)

    def generated(self, request_id: str) -> list[int] | None:
        """The tokens a single-completion request has produced so far (None: not open here, or n > 1)."""
        state = self.states.get(request_id)
        if state is None or len(state.completions) != 1:
            return None
        return list(state.completions[0].token_ids)

    def abort_requests(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.states.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.states)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> OutputBatch:
        batch = OutputBatch([], [])
        touched: dict[str, RequestState] = {}
        for out in outputs:
            state = self.states.get(out.request_id)
            if state is None or not 0 <= out.index < len(state.completions):
                continue  # aborted here after the engine core produced it
            touched[out.request_id] = state
            self._update(state, state.completions[out.index], out, batch)
        for rid, state in touched.items():
            batch.outputs.append(state.to_output())
            if state.finished:
                del self.states[rid]
                if len(state.completions) > 1:  # a stop string may have ended its last completion here:
                    batch.to_abort.append(rid)  # P1 then lets go of the request's items (else a no-op)
        return batch

    def _update(self, state: RequestState, completion: CompletionState, out: EngineCoreOutput,
                batch: OutputBatch) -> None:
        if completion.num_cached_tokens is None:
            completion.num_cached_tokens = out.num_cached_tokens
            if out.index == 0:
                state.num_cached_tokens = out.num_cached_tokens
                if state.report is not None:
                    state.report.merge(out.cache_counts)
                if out.prompt_logprobs is not None:
                    state.prompt_logprobs = [None] + [self._decode_logprobs(lp) for lp in out.prompt_logprobs]
                state.hidden = out.hidden
        if completion.finish_reason is not None:
            return  # finished here by a stop string; the engine's last tokens are dropped
        state.timed(out)
        completion.token_ids.extend(out.new_token_ids)
        if completion.logprobs is not None and out.new_logprobs:
            completion.logprobs.extend(self._decode_logprobs(lp) for lp in out.new_logprobs)
        stop_string = completion.detokenizer.update(out.new_token_ids, finished=out.finish_reason is not None)
        completion.finish_reason, completion.stop_reason = out.finish_reason, out.stop_reason
        if stop_string is not None and out.finish_reason is None:
            completion.finish_reason, completion.stop_reason = FinishReason.STOP, stop_string
            batch.to_abort.append(sibling_request_id(out.request_id, out.index, len(state.completions)))

    def _decode_logprobs(self, lp: TokenLogprobs) -> dict[int, Logprob]:
        """token id -> Logprob for the sampled token and its top alternatives."""
        entry = {tid: Logprob(value, rank, self._token_text(tid))
                 for rank, (tid, value) in enumerate(zip(lp.top_token_ids, lp.top_logprobs), start=1)}
        if lp.token_id not in entry:
            entry[lp.token_id] = Logprob(lp.logprob, lp.rank, self._token_text(lp.token_id))
        return entry

    def _token_text(self, token_id: int) -> str:
        """A token's text alone, decoded once per id (log probabilities name K + 1 tokens per
        position; a prompt's, every position: the vocabulary bounds this table)."""
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text
