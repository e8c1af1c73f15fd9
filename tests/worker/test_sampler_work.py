"""The sampler's per-step work, by the torch ops it runs (recorded under a dispatch mode): greedy
rows take an argmax and nothing else; top-k (with or without top-p) takes one `topk` of the
largest k and never sorts the vocabulary; requests without a seed draw their noise in one call.
And the tokens are exact: equal to a plain reference (the sort's top-k and top-p, the same race
with the same generators) for seeded rows, in mixed batches."""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mmserve.sampling_params import SamplingParams
from mmserve.worker.sampler import sample, top_p_cut_sorted

V = 4096


class OpLog(TorchDispatchMode):
    """Counts the aten ops run inside it, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def logits_for(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def ops_of(params: list[SamplingParams], generators=None) -> Counter[str]:
    logits = logits_for(len(params))
    generators = generators or [None] * len(params)
    with OpLog() as log:
        sample(logits, params, generators, torch.Generator().manual_seed(0))
    return log.ops


def reference(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> int:
    """One row by the book: temperature, top-k by a full sort, top-p by a full sort, the race."""
    row = logits[None] / p.temperature
    if p.top_k is not None:
        kth = row.sort(dim=-1, descending=True).values[:, p.top_k - 1:p.top_k]
        row = row.masked_fill(row < kth, float("-inf"))
    top_p_cut_sorted(row, torch.tensor([[p.top_p]]))
    q = torch.empty_like(row[0]).exponential_(generator=generator)
    return int((row.softmax(-1)[0] / q).argmax())


def test_greedy_rows_take_an_argmax_and_nothing_else():
    ops = ops_of([SamplingParams(temperature=0.0)] * 8)
    assert not {"sort", "topk", "softmax", "_softmax", "exponential_"} & set(ops), ops


def test_top_k_and_top_p_take_one_topk_and_no_sort():
    for params in ([SamplingParams(temperature=0.8, top_k=20)] * 4,
                   [SamplingParams(temperature=0.8, top_k=20, top_p=0.8), SamplingParams(temperature=1.0, top_k=5)]):
        ops = ops_of(params)
        assert ops["topk"] == 1 and ops["sort"] == 0, ops


def test_rows_without_a_seed_draw_their_noise_in_one_call():
    unseeded = SamplingParams(temperature=1.0)
    gens = [None] * 6 + [torch.Generator().manual_seed(1)]
    assert ops_of([unseeded] * 7, gens)["exponential_"] == 2  # six rows at once, the seeded row alone


def test_seeded_rows_sample_as_the_reference_does():
    cases = [SamplingParams(temperature=0.7, top_k=20, top_p=0.8, seed=1), SamplingParams(temperature=1.3, top_k=7),
             SamplingParams(temperature=1.0, top_p=0.5), SamplingParams(temperature=0.0),
             SamplingParams(temperature=0.9, top_k=3000, top_p=0.95), SamplingParams(temperature=1.0)]
    for trial in range(20):
        logits = logits_for(len(cases), seed=trial)
        for batch in (cases, cases[:1] + cases[4:5], cases[1:3]):  # all cut by top-k, and mixed
            seeds = [100 * trial + i for i in range(len(batch))]
            gens = [torch.Generator().manual_seed(s) for s in seeds]
            rows = logits[:len(batch)]
            got = sample(rows.clone(), batch, gens, torch.Generator().manual_seed(0)).tolist()
            want = [int(rows[i].argmax()) if p.greedy else reference(rows[i], p, torch.Generator().manual_seed(s))
                    for i, (p, s) in enumerate(zip(batch, seeds))]
            assert got == want, (trial, batch)
