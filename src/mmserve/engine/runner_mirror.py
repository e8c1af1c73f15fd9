"""What the model runner holds of each request, kept on the scheduler's side so a step sends only what is new.

A request is sent to the runner whole once (`NewRequestData`: its tokens so far, items,
parameters and blocks), then, each step it is scheduled again, as its new blocks alone
(`CachedRequestData`). Once it leaves running (finished, aborted, preempted: `drop`) the next
step's `SchedulerOutput.finished_req_ids` tells the runner to forget it (`take_dropped`); a
preempted request is sent whole again when it is readmitted.
"""

from __future__ import annotations

from mmserve.engine.kv_cache import KVCacheManager
from mmserve.engine.request import Request
from mmserve.ipc.worker_messages import CachedRequestData, NewRequestData, SchedulerOutput


class RunnerMirror:
    """The ids whose state the runner holds, and the ones it must drop at the next step."""

    def __init__(self, kv_cache: KVCacheManager) -> None:
        self.kv_cache = kv_cache
        self._known: set[str] = set()
        self._dropped: set[str] = set()  # to drop from the runner at the next step

    def take_dropped(self) -> list[str]:
        """The ids the runner must forget this step (sorted), and none left after."""
        dropped, self._dropped = sorted(self._dropped), set()
        return dropped

    def new(self, req: Request) -> NewRequestData:
        """All the runner keeps of `req`, sent once: its tokens so far, items, parameters, blocks."""
        self._known.add(req.request_id)
        return NewRequestData(req.request_id, list(req.all_token_ids), req.mm_items, req.sampling_params,
                              self.kv_cache.get_block_ids(req.request_id).copy(), req.num_computed_tokens,
                              req.num_prompt_tokens, req.eos_token_id, req.return_first_logits, req.return_hidden)

    def scheduled(self, req: Request, new_blocks: list[int], start: int, out: SchedulerOutput) -> None:
        """`req` runs this step from token `start`: whole if the runner lacks it, else its new blocks."""
        if req.request_id in self._known:
            out.cached_requests.append(CachedRequestData(req.request_id, new_blocks, start))
        else:
            out.new_requests.append(self.new(req))

    def drop(self, request_id: str) -> None:
        """`request_id` left running: the runner forgets it at the next step (if it ever had it)."""
        if request_id in self._known:
            self._known.discard(request_id)
            self._dropped.add(request_id)
