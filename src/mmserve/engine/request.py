"""A request's state inside the engine core."""

from __future__ import annotations

import enum

from mmserve.ipc.messages import EngineCoreRequest, FinishReason
from mmserve.multimodal.inputs import MultiModalItem
from mmserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()  # waiting again, its KV blocks gone; recomputed from token 0
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


class Request:
    """Tokens known so far (prompt + outputs) and how many of them have K/V in the cache.

    Invariant: 0 <= num_computed_tokens <= num_tokens. After a step has been scheduled,
    `num_computed_tokens` already counts its tokens (the runner computes them that step).
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], mm_items: list[MultiModalItem],
                 sampling_params: SamplingParams, eos_token_id: int | None, arrival_time: float) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.mm_items = mm_items
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | None = None
        self.num_preemptions = 0

    @classmethod
    def from_engine_core_request(cls, r: EngineCoreRequest) -> Request:
        return cls(r.request_id, r.prompt_token_ids, r.mm_items, r.sampling_params, r.eos_token_id, r.arrival_time)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids):]

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.all_token_ids.extend(token_ids)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
