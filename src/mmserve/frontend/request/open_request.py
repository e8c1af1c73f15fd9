"""One request as P0 holds it, from admission until its release: the one owner of its frontend state.

vLLM's v1 keeps a request's P0 state in the output processor's `RequestState` (its queue, its
detokenizer); ours holds, in the same object, what admission took for it and what a rank's death
needs to send it again, because those are one request's too:

- `queue` (`output_queue.py`): written by `OpenRequests.put` / `fail`;
- `pending`, the items processed for it and held out of the processor cache: filled by
  `InputProcessor.process`, emptied by `InputProcessor.accept` at the send (or `reject` in
  admission's undo);
- `output` (`output_processor.py: RequestState`, the detokenizers): the output processor's;
- `rank` and the kept `resend` copy: set by `RankSender.send`, the copy dropped by `shown`,
  `OpenRequests.fail` / `abort`;
- the store's pins on its items (`ItemTransport.to_wire`): held by the store under its id;
- `first_logits`, P1's first-token logits row of a cache-verifier candidate or shadow: set by the
  output loop, read by the verifier once the request has ended.

`OpenRequests.release` is the one place all of it ends, whatever ended the request (its last
output, an abort, the client gone, an engine death, a failure; a shadow re-run is a request of its own).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from mmserve.cache_report import CacheReport
from mmserve.frontend.output.output_processor import RequestState
from mmserve.frontend.request.output_queue import OutputQueue
from mmserve.frontend.request.prompt import Prompt
from mmserve.ipc.messages import EngineCoreRequest
from mmserve.multimodal.items import ResolvedItem
from mmserve.outputs import RequestOutput
from mmserve.sampling_params import SamplingParams


@dataclass(eq=False)
class OpenRequest:
    """Everything P0 holds for one request: prompt, queue, items, output state, rank, resend copy."""

    request_id: str
    prompt: Prompt
    params: SamplingParams
    stream: bool
    candidate: bool = False  # the cache verifier may re-run it (it asked for its first logits)
    priority: int = 0  # --scheduling-policy priority: the lower, the sooner it runs
    queue: OutputQueue = field(default_factory=OutputQueue)
    report: CacheReport = field(default_factory=CacheReport)
    pending: list[ResolvedItem] = field(default_factory=list)  # processed, held out of the processor cache
    output: RequestState | None = None  # None before admission registers it, once finished or aborted
    rank: int | None = None  # None until it is sent
    resend: EngineCoreRequest | None = None  # what is sent again (P1 lacked an item, its rank died); None: never
    origin: EngineCoreRequest | None = None  # the request as admitted, once it has resumed on another rank
    moves: int = 0  # times it was sent again because its rank died (`RankFailover`: at most once)
    started: bool = False  # its caller has seen output: it resumes rather than starts over
    finished: bool = False  # ended in P1 or failed here: nothing to abort
    last: RequestOutput | None = None  # the latest output its caller read
    first_logits: bytes | None = None  # P1's first-token logits row (float32), asked for by the verifier
    embed: bool = False  # an embedding request: P1 sends back its prompt's last hidden state

    async def next_output(self) -> RequestOutput:
        """The next output for the caller; the error that ended the request is raised instead."""
        item = await self.queue.get()
        if isinstance(item, Exception):
            self.finished = True
            raise item
        self.finished, self.last = item.finished, item
        return item

    def shown(self, result: RequestOutput) -> None:
        """An output is on its way to the caller: after a streamed one the request can only resume,
        and only if `resumable`; after the last one it is not sent again."""
        if result.finished:
            self.resend = None
        elif self.stream and not self.started and self.resend is not None:
            self.started = True
            if not resumable(self.resend.sampling_params):
                self.resend = None


def resumable(params: SamplingParams) -> bool:
    """Whether a request that has streamed output can go on exactly from its prompt and those tokens:
    one completion, and no state beyond the tokens (no grammar, no output-only penalties)."""
    return (params.n == 1 and params.structured_outputs is None and params.frequency_penalty == 0
            and params.presence_penalty == 0)


def resumed(request: EngineCoreRequest, generated: list[int]) -> EngineCoreRequest | None:
    """The request that goes on after `generated` tokens: they join the prompt and leave the budget
    (None when nothing is left to generate)."""
    params = request.sampling_params
    left = params.max_tokens - len(generated)
    if left < 1:
        return None
    params = msgspec.structs.replace(params, max_tokens=left, min_tokens=max(0, params.min_tokens - len(generated)))
    return msgspec.structs.replace(request, prompt_token_ids=request.prompt_token_ids + generated,
                                   sampling_params=params, return_first_logits=False)
