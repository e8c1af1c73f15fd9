"""One step's inputs, built on the host from the runner's request states (`prepare_inputs`).

Everything here is a CPU tensor; the runner moves the whole `StepInputs` to its device in one
pinned copy (`worker/device.py: to_device`). A plain decode step that a CUDA graph holds gets
`GraphInputs` (slot mapping, block tables, sequence lengths) instead of the backend's metadata.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from mmserve.ipc.messages import TokenLogprobs
from mmserve.models.attention.host_metadata import padded_tables, token_slots
from mmserve.worker.cuda_graphs import DecodeGraphs, GraphInputs
from mmserve.worker.prompt_logprobs import PromptRows, prompt_rows
from mmserve.worker.runner_state import RunnerRequest
from mmserve.worker.sampler import SampledStep


@dataclass
class StepInputs:
    """One step's inputs: host tensors until `to_device` moves them all in one copy."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] or [3, T] (M-RoPE) int64
    meta: Any  # the attention backend's step metadata; None for a step run by the decode graphs
    logits_rows: torch.Tensor  # [R] int64: the row of `hidden` each sampling request samples from
    sampling: list[str]  # the R requests that sample, in row order
    graph_inputs: GraphInputs | None = None  # a plain decode step the decode graphs hold
    # (row of input_ids, request id): decoding tokens still in flight when the step was built (a
    # placeholder 0 in input_ids until `ModelRunner.launch` reads them from the step that sampled them)
    late: list[tuple[int, str]] = field(default_factory=list, init=False)
    prompt_rows: list[PromptRows] = field(default_factory=list, init=False)  # rows scoring prompt tokens


def prepare_inputs(requests: dict[str, RunnerRequest], req_ids: list[str], num_sched: dict[str, int],
                   block_size: int, build_metadata: Callable[..., Any],
                   graphs: DecodeGraphs | None = None) -> StepInputs:
    """The step's token ids, positions, attention metadata and sampling rows (request order). A
    decoding token the device sampled last step and the host has not yet read (--async-scheduling)
    is a placeholder, listed in `late`; rows that score prompt tokens are in `prompt_rows`."""
    input_ids: list[int] = []
    query_lens, seq_lens, tables, logits_rows, sampling = [], [], [], [], []
    late: list[tuple[int, str]] = []
    scoring: list[PromptRows] = []
    for rid in req_ids:
        state, n = requests[rid], num_sched[rid]
        start, known = state.num_computed_tokens, len(state.token_ids)
        if (scores := prompt_rows(state, rid, len(input_ids), start, n)) is not None:
            scoring.append(scores)
        if n == 1:
            if start == known:  # in flight
                late.append((len(input_ids), rid))
            input_ids.append(state.token_ids[start] if start < known else 0)
        else:
            input_ids.extend(state.token_ids[start:start + n])
        query_lens.append(n)
        seq_lens.append(start + n)
        tables.append(state.block_ids)
        if start + n == known + state.num_in_flight:  # reaches the end of its tokens: samples one
            logits_rows.append(len(input_ids) - 1)
            sampling.append(rid)
    positions = _positions([requests[rid] for rid in req_ids], query_lens, seq_lens)
    ids, rows = torch.tensor(input_ids, dtype=torch.int64), torch.tensor(logits_rows, dtype=torch.int64)
    if graphs is not None and _plain_decode(requests, req_ids, query_lens, graphs):
        inputs = StepInputs(ids, positions, None, rows, sampling, _graph_inputs(seq_lens, tables, block_size))
    else:
        inputs = StepInputs(ids, positions, build_metadata(query_lens, seq_lens, tables, block_size), rows, sampling)
    inputs.late, inputs.prompt_rows = late, scoring
    return inputs


def late_indices(inputs: StepInputs, previous: LaunchedStep | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """For a step's tokens in flight: (their rows in `input_ids`, their rows in `previous`'s sampled
    tokens) [n] int64 each, host tensors; None when it has none."""
    if not inputs.late:
        return None
    assert previous is not None, "a step's tokens in flight were sampled by the step before it"
    row_of = {rid: i for i, rid in enumerate(previous.sampling)}
    return (torch.tensor([row for row, _ in inputs.late], dtype=torch.int64),
            torch.tensor([row_of[rid] for _, rid in inputs.late], dtype=torch.int64))


def _positions(states: list[RunnerRequest], query_lens: list[int], seq_lens: list[int]) -> torch.Tensor:
    """[T] or [3, T] (M-RoPE) int64: a decoding token's position is one number (its index, or past
    its M-RoPE table index + delta on every row), made one tensor with its neighbours' without a
    tensor op per request; a chunk's come from `RunnerRequest.positions`."""
    mrope = states[0].mrope is not None
    pieces: list[torch.Tensor] = []
    single: list[int] = []
    for state, q, s in zip(states, query_lens, seq_lens):
        position = state.scalar_position(s - 1) if q == 1 else None
        if position is not None:
            single.append(position)
            continue
        if single:
            pieces.append(_expand(torch.tensor(single, dtype=torch.int64), mrope))
            single = []
        pieces.append(state.positions(s - q, s))
    if single:
        pieces.append(_expand(torch.tensor(single, dtype=torch.int64), mrope))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)


def _expand(positions: torch.Tensor, mrope: bool) -> torch.Tensor:
    return positions.expand(3, -1).contiguous() if mrope else positions


def _plain_decode(requests: dict[str, RunnerRequest], req_ids: list[str], query_lens: list[int],
                  graphs: DecodeGraphs) -> bool:
    """One new token per request, none of them an image placeholder, and a graph that holds them."""
    if any(q != 1 for q in query_lens):
        return False
    for rid in req_ids:
        state = requests[rid]
        pos = state.num_computed_tokens
        if any(item.placeholder.offset <= pos < item.placeholder.end for item in state.mm_items):
            return False
    widest = max(len(requests[rid].block_ids) for rid in req_ids)
    return graphs.size_for(len(req_ids), widest) is not None


def _graph_inputs(seq_lens: list[int], tables: list[list[int]], block_size: int) -> GraphInputs:
    """Each decoding token's slot, the block tables padded to the widest, the lengths."""
    padded = padded_tables(tables, torch.int64)
    slots = token_slots(padded, [1] * len(seq_lens), seq_lens, block_size)
    return GraphInputs(slots, padded, torch.tensor(seq_lens, dtype=torch.int64))


@dataclass
class PreparedStep:
    """A step's host work done (`ModelRunner.prepare`): its requests, tokens each and inputs."""

    req_ids: list[str]
    num_scheduled: dict[str, int]
    inputs: StepInputs
    threads: int  # torch threads for its forward


@dataclass
class LaunchedStep:
    """A step on the device (`ModelRunner.launch`): its requests, those that sample (in row order)
    with their logits [R, V] until `ModelRunner.sample` takes them, then their tokens on the way
    (`sampled`; None before, or when none samples)."""

    req_ids: list[str]
    sampling: list[str]
    logits: torch.Tensor | None
    sampled: SampledStep | None = None
    first_logits: dict[str, bytes] = field(default_factory=dict)
    hidden_rows: dict[str, torch.Tensor] = field(default_factory=dict)  # rid -> [D] on the device, until `sample`
    hidden: dict[str, bytes] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
