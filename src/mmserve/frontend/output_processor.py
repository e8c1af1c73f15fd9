"""P0's output processing: engine-core token outputs -> detokenized `RequestOutput`s.

Stop strings are found here, while detokenizing; such requests are finished here and
returned in `OutputBatch.to_abort` so the engine core frees them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mmserve.frontend.detokenizer import IncrementalDetokenizer
from mmserve.ipc.messages import EngineCoreOutput, EngineCoreRequest, FinishReason
from mmserve.outputs import CompletionOutput, RequestOutput


@dataclass
class RequestState:
    request: EngineCoreRequest
    prompt: str | None
    detokenizer: IncrementalDetokenizer
    output_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int | None = None  # from the request's first engine-core output

    def to_output(self, finish_reason: str | None, stop_reason: int | str | None) -> RequestOutput:
        delta = self.detokenizer.take_delta(finished=finish_reason is not None)
        completion = CompletionOutput(0, self.detokenizer.output_text, list(self.output_token_ids),
                                      finish_reason, stop_reason, delta)
        return RequestOutput(self.request.request_id, self.prompt, self.request.prompt_token_ids,
                             [completion], finish_reason is not None, self.num_cached_tokens)


@dataclass
class OutputBatch:
    outputs: list[RequestOutput]
    to_abort: list[str]


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add_request(self, request: EngineCoreRequest, prompt: str | None) -> None:
        detok = IncrementalDetokenizer(self.tokenizer, request.sampling_params)
        self.states[request.request_id] = RequestState(request, prompt, detok)

    def abort_requests(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.states.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.states)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> OutputBatch:
        batch = OutputBatch([], [])
        for out in outputs:
            state = self.states.get(out.request_id)
            if state is None:
                continue  # aborted here after the engine core produced it
            if state.num_cached_tokens is None:
                state.num_cached_tokens = out.num_cached_tokens
            state.output_token_ids.extend(out.new_token_ids)
            stop_string = state.detokenizer.update(out.new_token_ids, finished=out.finish_reason is not None)
            finish_reason, stop_reason = out.finish_reason, out.stop_reason
            if stop_string is not None and finish_reason is None:
                finish_reason, stop_reason = FinishReason.STOP, stop_string
                batch.to_abort.append(out.request_id)
            batch.outputs.append(state.to_output(finish_reason, stop_reason))
            if finish_reason is not None:
                del self.states[out.request_id]
        return batch
