"""Sampling the next token of each request from its logits row, batched on the logits' device.

The rows are first processed (`logits_processors.py`: min_tokens, logit_bias, penalties,
structured-output masks; rows asking for none of these are not touched). Greedy rows then take
the argmax, and nothing else: no sort, no softmax. Other rows are scaled by their temperatures,
cut by top-k (one `topk` of the largest k, never a sort of the vocabulary) and top-p (within the
top-k candidates when every row has a top-k; else from the 1,024 most likely tokens on the CPU or
one sort of the batch), and sampled with the exponential-race trick (argmax of p / q, q ~ Exp(1)):
the q of every row without a seed in one draw from the engine's generator, a seeded request's
from its own, so a seeded request samples the same tokens whatever else shares its batch.

Log probabilities (`SamplingParams.logprobs`) are the log-softmax of the processed row divided by
the temperature (1 when greedy), before top-k / top-p: the distribution the token was sampled
from, with every alternative still finite (see `SamplingParams`).

The sampled ids and the log probabilities come back to the host together, as one float64 tensor
(the step's one device-to-host transfer; ids and ranks are exact in float64): started by
`launch_sampling`, waited for by `collect_sampled`, so that with --async-scheduling the host builds
the next step while the device samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from mmserve.ipc.messages import TokenLogprobs
from mmserve.sampling_params import SamplingParams
from mmserve.worker.device import to_device, to_host_async
from mmserve.worker.logits_processors import process_logits, record_sampled

if TYPE_CHECKING:
    from mmserve.worker.runner_state import RunnerRequest


@dataclass
class SampledStep:
    """One step's sampled tokens (and log probabilities) on their way to the host: `host` [R (+ L *
    width)] float64 is filled once `ready` (a CUDA event; None: filled already) has fired."""

    states: list[RunnerRequest]  # row i sampled for states[i]
    params: list[SamplingParams]
    tokens: torch.Tensor  # [R] int64 on the device: the next step's inputs in flight are read from it
    host: torch.Tensor
    ready: Any
    logprob_rows: list[int]


def launch_sampling(logits: torch.Tensor, states: list[RunnerRequest], default_generator: torch.Generator,
                    control_tokens: torch.Tensor | None = None) -> SampledStep:
    """Sample one token per row of logits [R, V] float32 (row i of `states[i]`) on the logits'
    device and start their copy to the host; each state has one token in flight until
    `collect_sampled`."""
    process_logits(logits, states, control_tokens)
    params = [s.params for s in states]
    tokens = sample(logits, params, [s.generator for s in states], default_generator)  # [R] int64
    rows, block = compute_logprobs(logits, params, tokens)
    packed = tokens.double() if block is None else torch.cat([tokens.double(), block.reshape(-1)])
    host, ready = to_host_async(packed)
    for state in states:
        state.num_in_flight = 1
    return SampledStep(states, params, tokens, host, ready, rows)


def collect_sampled(step: SampledStep) -> tuple[list[int], list[TokenLogprobs | None]]:
    """Wait for `step`'s tokens; append each to its request's state (structured requests' matchers
    accept it, penalised requests count it) and return them with their log probabilities."""
    if step.ready is not None:
        step.ready.synchronize()
    host = step.host.tolist()
    states = step.states
    token_ids = [int(t) for t in host[:len(states)]]
    for state, token in zip(states, token_ids):
        state.token_ids.append(token)
        state.num_in_flight = 0
    record_sampled(states, token_ids)
    for state, token in zip(states, token_ids):
        if state.grammar is not None:
            state.grammar.accept(token)
    return token_ids, _unpack_logprobs(host[len(states):], step.logprob_rows, step.params, token_ids)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           default_generator: torch.Generator) -> torch.Tensor:
    """logits: [R, V] float32, one row per request -> [R] int64 token ids, on the logits' device."""
    tokens = logits.argmax(dim=-1)  # [R]
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        rows = to_device(_RowParams.build(random_rows, params, logits.shape[-1]), logits.device)
        every = len(random_rows) == len(params)  # no gather, no scatter
        sampled = _sample_rows(logits if every else logits[rows.index], rows,
                               [generators[i] for i in random_rows], default_generator)
        if every:
            return sampled
        tokens[rows.index] = sampled
    return tokens


@dataclass
class _RowParams:
    """The sampling rows' parameters as tensors, built on the host and moved in one copy."""

    index: torch.Tensor  # [n] int64: the rows that sample
    temperature: torch.Tensor  # [n, 1] float32
    top_p: torch.Tensor  # [n, 1] float32 (1: no cut)
    min_p: torch.Tensor  # [n, 1] float32 (0: no cut)
    cut_rows: torch.Tensor  # [m] int64: positions in `index` with a top-k cut
    cut_k: torch.Tensor  # [m] int64: their k
    max_k: int  # the largest k (0: no row cuts)
    all_cut: bool  # every row has a top-k cut
    any_top_p: bool
    any_min_p: bool

    @classmethod
    def build(cls, rows: list[int], params: list[SamplingParams], vocab_size: int) -> _RowParams:
        chosen = [params[i] for i in rows]
        cut = [(j, p.top_k) for j, p in enumerate(chosen) if p.top_k is not None and p.top_k < vocab_size]
        return cls(torch.tensor(rows, dtype=torch.int64), torch.tensor([[p.temperature] for p in chosen]),
                   torch.tensor([[p.top_p] for p in chosen]), torch.tensor([[p.min_p] for p in chosen]),
                   torch.tensor([j for j, _ in cut], dtype=torch.int64),
                   torch.tensor([k for _, k in cut], dtype=torch.int64), max((k for _, k in cut), default=0),
                   len(cut) == len(chosen), any(p.top_p < 1.0 for p in chosen), any(p.min_p > 0.0 for p in chosen))


def compute_logprobs(logits: torch.Tensor, params: list[SamplingParams],
                     tokens: torch.Tensor) -> tuple[list[int], torch.Tensor | None]:
    """The asking rows, and for each [2 + 2K] float64: the sampled token's log probability, its
    rank (1 = most likely), the top K ids and their log probabilities (K the largest asked)."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return rows, None
    host_temps = torch.tensor([[1.0 if params[i].greedy else params[i].temperature] for i in rows])  # [L, 1]
    index, temps = to_device((torch.tensor(rows, dtype=torch.int64), host_temps), logits.device)
    lp = torch.log_softmax(logits[index] / temps, dim=-1)  # [L, V]
    chosen_lp = lp.gather(1, tokens[index][:, None])  # [L, 1]
    ranks = (lp > chosen_lp).sum(-1, keepdim=True) + 1  # [L, 1]
    parts = [chosen_lp.double(), ranks.double()]
    k_max = max(params[i].logprobs or 0 for i in rows)
    if k_max:
        top = lp.topk(k_max, dim=-1)
        parts += [top.indices.double(), top.values.double()]
    return rows, torch.cat(parts, dim=1)


def _unpack_logprobs(flat: list[float], rows: list[int], params: list[SamplingParams],
                     tokens: list[int]) -> list[TokenLogprobs | None]:
    """`compute_logprobs`' block, read back on the host, as one `TokenLogprobs` per asking row."""
    result: list[TokenLogprobs | None] = [None] * len(params)
    if not rows:
        return result
    width = len(flat) // len(rows)
    k_max = (width - 2) // 2
    for j, i in enumerate(rows):
        row, k = flat[j * width:(j + 1) * width], params[i].logprobs or 0
        result[i] = TokenLogprobs(tokens[i], row[0], int(row[1]), [int(t) for t in row[2:2 + k]],
                                  row[2 + k_max:2 + k_max + k])
    return result


def _sample_rows(logits: torch.Tensor, rows: _RowParams, generators: list[torch.Generator | None],
                 default_generator: torch.Generator) -> torch.Tensor:
    """logits: [n, V] of sampling rows -> [n] sampled ids (temperature, top-k, top-p, the race)."""
    logits = logits / rows.temperature  # a new tensor: masked in place below
    if rows.any_min_p:  # vLLM's order: after the temperature, before top-k / top-p
        probs = logits.softmax(-1)
        logits.masked_fill_(probs < rows.min_p * probs.amax(-1, keepdim=True), float("-inf"))
    candidates = None
    if rows.max_k:
        kth, candidates = _kth_largest(logits, rows)
        logits.masked_fill_(logits < kth, float("-inf"))
    if rows.any_top_p:
        if rows.all_cut and candidates is not None:  # every nucleus lies within its row's top-k: no sort
            _keep_nucleus(logits, rows.top_p, logits.gather(1, candidates).softmax(-1), candidates)
        else:
            top_p_cut(logits, rows.top_p)
    probs = logits.softmax(-1)
    return (probs / _exponentials(probs, generators, default_generator)).argmax(dim=-1)


def _exponentials(probs: torch.Tensor, generators: list[torch.Generator | None],
                  default_generator: torch.Generator) -> torch.Tensor:
    """q ~ Exp(1) shaped as probs [n, V]: the rows of requests without a generator of their own in
    one draw from `default_generator`, each seeded request's row from its own generator (its draws
    depend on its seed alone, whatever shares the batch)."""
    q = torch.empty_like(probs)
    if any(g is None for g in generators):
        q.exponential_(generator=default_generator)
    for row, generator in zip(q, generators):
        if generator is not None:
            row.exponential_(generator=generator)
    return q


# top-p looks at this many most likely tokens first: a row whose nucleus lies within them needs
# no sort of the vocabulary
TOP_P_CANDIDATES = 1024


def top_p_cut(logits: torch.Tensor, top_p: torch.Tensor) -> None:
    """Mask to -inf, in place, every token of logits [n, V] outside its row's nucleus: the
    smallest set of most likely tokens whose probability reaches top_p [n, 1] (rows at 1: no cut).
    From the `TOP_P_CANDIDATES` most likely tokens when every cut row's nucleus lies within them
    (their mass reaches top_p), else by a sort of the whole vocabulary (`top_p_cut_sorted`); off
    the CPU always by the sort (deciding would cost a device-to-host sync)."""
    k = min(TOP_P_CANDIDATES, logits.shape[-1])
    if logits.device.type != "cpu" or k == logits.shape[-1]:
        return top_p_cut_sorted(logits, top_p)
    probs = logits.softmax(-1)
    top = probs.topk(k, dim=-1)  # [n, k] descending
    cut = top_p < 1.0
    if not bool(((top.values.sum(-1, keepdim=True) >= top_p) | ~cut).all()):
        return top_p_cut_sorted(logits, top_p)
    _keep_nucleus(logits, top_p, top.values, top.indices)


def _keep_nucleus(logits: torch.Tensor, top_p: torch.Tensor, probs: torch.Tensor, candidates: torch.Tensor) -> None:
    """Mask to -inf, in place, every token of logits [n, V] outside its row's nucleus, the row's
    `candidates` [n, c] (token ids, most likely first; `probs` [n, c] their probabilities) holding
    it: the smallest prefix whose mass reaches top_p [n, 1] is kept, every token past it or past
    the candidates dropped (rows at top_p 1 keep everything). Equal to the sort's cut
    (`top_p_cut_sorted`) unless tokens tied in probability straddle the candidates' end."""
    cut = top_p < 1.0
    keep = (probs.cumsum(-1) - probs < top_p) | ~cut  # [n, c]
    kept = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, candidates, keep)
    logits.masked_fill_(~kept & cut, float("-inf"))


def top_p_cut_sorted(logits: torch.Tensor, top_p: torch.Tensor) -> None:
    """`top_p_cut` by one sort of each row's whole vocabulary."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    sorted_probs = sorted_logits.softmax(-1)
    # keep the smallest prefix reaching top_p (rows asking no top-p keep everything)
    drop = (sorted_probs.cumsum(-1) - sorted_probs >= top_p) & (top_p < 1.0)
    logits.masked_fill_(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))


def _kth_largest(logits: torch.Tensor, rows: _RowParams) -> tuple[torch.Tensor, torch.Tensor | None]:
    """([n, 1]: each cut row's k-th largest logit, other rows -inf (no cut); when every row is cut,
    the [n, max_k] ids of each row's largest logits, most likely first, else None): one `topk` of
    the largest k over the cut rows, not a sort of the vocabulary."""
    cut = logits if rows.all_cut else logits[rows.cut_rows]
    top = cut.topk(rows.max_k, dim=-1)  # [m, max_k], descending
    if rows.all_cut:
        return top.values.gather(1, rows.cut_k[:, None] - 1), top.indices
    kth = torch.full((logits.shape[0], 1), float("-inf"), dtype=logits.dtype, device=logits.device)
    kth[rows.cut_rows] = top.values.gather(1, rows.cut_k[:, None] - 1)
    return kth, None
