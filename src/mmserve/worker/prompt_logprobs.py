"""Prompt log probabilities (`SamplingParams.prompt_logprobs`): what a prefill chunk's hidden rows
say of the prompt tokens after them.

The hidden row of prompt position p predicts token p + 1, so a chunk computing positions [s, e)
scores prompt tokens s + 1 .. min(e, P - 1) (P the prompt's length; position P - 1 predicts the
first output, which is sampled, not scored). `prepare_inputs` lists each asking request's rows
(`PromptRows`); after the forward, `score_prompts` runs the LM head over them in slices of at most
`SLICE_ROWS` rows (a [rows, V] float32 block: 256 rows of a 152k vocabulary are 156 MB) and returns
each token's raw log probability, rank and top K, read back to the host at once: a request that
asks pays one synchronisation per chunk, the others nothing.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from mmserve.ipc.messages import TokenLogprobs
from mmserve.worker.device import to_device
from mmserve.worker.runner_state import RunnerRequest

SLICE_ROWS = 256


class PromptRows(NamedTuple):
    """Request `request_id`'s `num` hidden rows from `row`, scoring prompt tokens from `first`."""

    request_id: str
    row: int
    num: int
    first: int


def prompt_rows(state: RunnerRequest, request_id: str, row: int, start: int, n: int) -> PromptRows | None:
    """The rows of a chunk of `n` tokens from position `start` (at `row` of the step) that score
    prompt tokens, when the request asks for them; else None."""
    if state.params.prompt_logprobs is None:
        return None
    count = min(start + n, state.num_prompt_tokens - 1) - start
    return PromptRows(request_id, row, count, start + 1) if count > 0 else None


Scored = dict[str, tuple[int, list[TokenLogprobs]]]  # request id -> (first scored token, entries)


def score_prompts(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                  rows: list[PromptRows], requests: dict[str, RunnerRequest]) -> Scored:
    """request id -> (first scored token, one `TokenLogprobs` per scored token). hidden: [T, D]."""
    scored: Scored = {}
    for r in rows:
        k = requests[r.request_id].params.prompt_logprobs or 0
        targets = requests[r.request_id].token_ids[r.first:r.first + r.num]
        entries = []
        for s in range(0, r.num, SLICE_ROWS):
            chunk = targets[s:s + SLICE_ROWS]
            lp = torch.log_softmax(compute_logits(hidden[r.row + s:r.row + s + len(chunk)]).float(), dim=-1)  # [m, V]
            index = to_device(torch.tensor(chunk, dtype=torch.int64)[:, None], lp.device)
            chosen = lp.gather(1, index)  # [m, 1]
            parts = [chosen, (lp > chosen).sum(-1, keepdim=True) + 1]  # the log probability, the rank
            if k:
                top = lp.topk(k, dim=-1)
                parts += [top.indices, top.values]
            block = torch.cat([p.double() for p in parts], dim=1).cpu().tolist()  # [m, 2 + 2K]
            entries += [TokenLogprobs(token, row[0], int(row[1]), [int(t) for t in row[2:2 + k]], row[2 + k:])
                        for token, row in zip(chunk, block)]
        scored[r.request_id] = (r.first, entries)
    return scored
