"""Megatron-style tensor parallelism: the rank's place in the group and the sharded layers.

Every rank holds a slice of each big weight and the same activations at layer boundaries:

- `ColumnParallelLinear` splits the output features (Q/K/V, gate/up, fc1, projector linear_1):
  the rank computes its share of the outputs, no communication.
- `RowParallelLinear` splits the input features (o_proj, down_proj, out_proj, fc2, projector
  linear_2): each rank's partial product is summed with one all-reduce; the bias is added once,
  after the sum, so every rank ends with the same full output.
- Embedding and LM head are **vocab-parallel**: each rank holds `ceil(V / N)` rows (the last
  rank's rows past V are zero padding). The embedding zeroes ids outside the rank's rows and
  all-reduces; the LM head all-gathers the logits, so every rank has all V logits and samples the
  same tokens (each rank keeps the same token history; only rank 0 reports them).
- Norms, rotary, the vision embeddings and biases of row-parallel layers are replicated.

Heads split evenly; KV heads split when there are at least N of them, otherwise each is
replicated on N / Hkv ranks (rank r uses KV head r // (N / Hkv)). `registry.py: check_shardable` names any
size that does not divide. With `size == 1` (`SINGLE`) every layer is the plain layer: the same
parameter shapes and names, and no collectives.

Each sharded parameter's slice of the checkpoint is in its module's `tp_shards` (parameter name
-> `Shard`), which the loader reads with `safe_open(...).get_slice(name)[...]`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mmserve.models.hf_config import TextConfig


@dataclass(frozen=True)
class TensorParallel:
    """This process's rank in a tensor-parallel group of `size` (the default process group)."""

    rank: int = 0
    size: int = 1

    def split(self, n: int, what: str) -> int:
        """n / size, or a ValueError naming `what` when it does not divide."""
        if n % self.size:
            raise ValueError(f"{what} ({n}) is not divisible by --tensor-parallel-size ({self.size})")
        return n // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """x: [R, C] on each rank -> [R, size * C], rank 0's columns first."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


SINGLE = TensorParallel()


@dataclass(frozen=True)
class Shard:
    """A parameter holds checkpoint indices [start, start + length) along `dim` (zero-padded
    past `length` when the parameter is longer, e.g. the last rank's vocab rows)."""

    dim: int
    start: int
    length: int


def kv_head_shard(num_kv_heads: int, tp: TensorParallel) -> tuple[int, int]:
    """(first KV head, KV heads) this rank holds: a split, or one replicated head."""
    if num_kv_heads >= tp.size:
        per = tp.split(num_kv_heads, "num_key_value_heads")
        return tp.rank * per, per
    if tp.size % num_kv_heads:
        raise ValueError(f"--tensor-parallel-size ({tp.size}) must be a multiple of num_key_value_heads "
                         f"({num_kv_heads}) when it is larger (KV heads are then replicated)")
    return tp.rank // (tp.size // num_kv_heads), 1


def check_decoder_shardable(t: TextConfig, tp: TensorParallel) -> None:
    """The decoder's part of `check_shardable`: heads, KV heads, MLP inner features."""
    tp.split(t.num_attention_heads, "the decoder's num_attention_heads")
    kv_head_shard(t.num_key_value_heads, tp)
    tp.split(t.intermediate_size, "the decoder's intermediate_size")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, or oneDNN's matmul when `pack_linears` packed the weight (an mkldnn tensor)."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def pack_linears(model: nn.Module) -> int:
    """Each float32 CPU weight of the column- and row-parallel layers (the decoder's projections
    and MLPs, projectors) replaced by oneDNN's packed copy of it, which `linear` multiplies by:
    `F.linear` (MKL's sgemm) is several times slower on a decode step's skinny matmuls, and slower
    on prefill's too, where it was measured (`benchmarks/decode_step.py`). First, the sibling
    projections a module names in `fused_projections` (Q/K/V, gate/up: one input each) become one
    matrix (`project`): one call instead of several, each with its own threads' start and end.
    The dense weights are freed; the loader must have loaded them first. Returns the number of
    matrices packed."""
    if not torch.backends.mkldnn.is_available():
        return 0
    packed = 0
    for module in list(model.modules()):
        for names in getattr(module, "fused_projections", ()):
            layers = [getattr(module, name) for name in names]
            if all(isinstance(layer, ColumnParallelLinear) and _packable(layer.weight) for layer in layers):
                _fuse(layers)
                packed += 1
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and _packable(module.weight):
            module.weight = nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), None),
                                         requires_grad=False)
            packed += 1
    return packed


def _packable(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and not weight.is_mkldnn and weight.numel() > 0


def _fuse(layers: list[ColumnParallelLinear]) -> None:
    """The layers' weights stacked by rows and packed, as the first layer's `fused_weight` (and
    `fused_bias`, a missing bias as zeros; `fused_sizes`: each layer's outputs); their own freed."""
    weight = torch.cat([layer.weight.detach() for layer in layers])
    bias = None
    if any(layer.bias is not None for layer in layers):
        bias = torch.cat([layer.bias.detach() if layer.bias is not None else torch.zeros(layer.weight.shape[0])
                          for layer in layers])
    sizes = [int(layer.weight.shape[0]) for layer in layers]
    for layer in layers:
        layer.weight = nn.Parameter(torch.empty(0), requires_grad=False)
        layer.bias = None
    first = layers[0]
    first.fused_weight = nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(weight, None), requires_grad=False)
    first.fused_bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
    first.fused_sizes = sizes


def project(x: torch.Tensor, *layers: ColumnParallelLinear) -> tuple[torch.Tensor, ...]:
    """Each of `layers`' outputs for the same input `x`: one matmul when `pack_linears` fused
    them (views of its output's columns), else one call each."""
    first = layers[0]
    if first.fused_sizes is None:
        return tuple(layer(x) for layer in layers)
    return linear(x, first.fused_weight, first.fused_bias).split(first.fused_sizes, dim=-1)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's rows (output features) split: x [.., in] -> [.., out / size].

    `rows` overrides the even split with (start, length), e.g. a replicated KV head."""

    # the first of sibling layers that `pack_linears` fused holds their matrix (`project`)
    fused_weight: torch.Tensor
    fused_bias: torch.Tensor | None
    fused_sizes: list[int] | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel,
                 rows: tuple[int, int] | None = None, what: str = "out_features") -> None:
        super().__init__()
        if rows is None:
            per = tp.split(out_features, what)
            rows = (tp.rank * per, per)
        start, length = rows
        self.weight = nn.Parameter(torch.empty(length, in_features))
        self.bias = nn.Parameter(torch.empty(length)) if bias else None
        self.tp_shards = {"weight": Shard(0, start, length), "bias": Shard(0, start, length)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_r W_r^T, + b: x [.., in / size] -> [.., out] (all-reduced)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel,
                 what: str = "in_features") -> None:
        super().__init__()
        per = tp.split(in_features, what)
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, per))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None  # replicated
        self.tp_shards = {"weight": Shard(1, tp.rank * per, per)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:  # the fused bias add, bit for bit nn.Linear
            return linear(x, self.weight, self.bias)
        y = self.tp.all_reduce(linear(x, self.weight))
        return y if self.bias is None else y + self.bias


def _vocab_rows(vocab_size: int, tp: TensorParallel) -> tuple[int, int, int]:
    """(first row, real rows, rows held): ceil(V / size) rows each, the tail zero-padded."""
    per = -(-vocab_size // tp.size)
    start = tp.rank * per
    return start, max(0, min(per, vocab_size - start)), per


class VocabParallelEmbedding(nn.Module):
    """ids [T] -> [T, D]; each rank looks up its own rows and the sum over ranks is the result."""

    def __init__(self, vocab_size: int, dim: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.start, real, per = _vocab_rows(vocab_size, tp)
        self.weight = nn.Parameter(torch.empty(per, dim))
        self.tp_shards = {"weight": Shard(0, self.start, real)}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])  # [T]
        out = F.embedding(torch.where(mine, local, 0), self.weight) * mine[:, None]  # [T, D]
        return self.tp.all_reduce(out)


class ParallelLMHead(nn.Module):
    """hidden [R, D] -> logits [R, V] on every rank (each computes its rows, then all-gather)."""

    def __init__(self, vocab_size: int, dim: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp, self.vocab_size = tp, vocab_size
        start, real, per = _vocab_rows(vocab_size, tp)
        self.weight = nn.Parameter(torch.empty(per, dim))
        self.tp_shards = {"weight": Shard(0, start, real)}

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.tp.all_gather(F.linear(hidden, self.weight))  # [R, size * per]
        return logits[:, :self.vocab_size]
