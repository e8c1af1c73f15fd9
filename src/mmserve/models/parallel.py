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
-> `Shard`), which the loader reads with `safe_open(...).get_slice(name)[...]`. A linear layer's
weight tensors and their slices come from its `LinearMethod` (models/quantization/): dense, or a
quantized format whose packed tensors are sliced along their own packing (int4 words of eight
rows or columns, a group's scale, an FP8 block's scale).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mmserve.models.hf_config import TextConfig
from mmserve.models.quantization.base import DENSE, LinearMethod, LinearShape, Shard, linear, onednn_packed

__all__ = ["Shard", "linear"]  # re-exported: the loader and models name them from here


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


class ParallelLinear(nn.Module):
    """A linear layer whose weight is held and multiplied by its `method` (dense until the loader
    sets another, models/quantization/): `shape` is this rank's part of W [out, in]."""

    weights_processed = False  # the loader's mark: the method's resident form is in place

    def __init__(self, shape: LinearShape, bias_shard: Shard | None, bias: bool) -> None:
        super().__init__()
        self.shape = shape
        self.tp_shards: dict[str, Shard | list[Shard]] = {} if bias_shard is None else {"bias": bias_shard}
        self.method: LinearMethod = DENSE
        DENSE.create_weights(self, shape)
        self.bias = nn.Parameter(torch.empty(shape.out_features)) if bias else None
        self.fused: FusedLinear | None = None  # set on the first of fused siblings (`fuse_projections`)

    def set_method(self, method: LinearMethod) -> None:
        """Hold the weight as `method` does (its checkpoint tensors, registered uninitialised)."""
        for name in self.weight_names:
            delattr(self, name)
            self.tp_shards.pop(name, None)
        self.weight_names: list[str] = []
        self.method = method
        method.create_weights(self, self.shape)


class ColumnParallelLinear(ParallelLinear):
    """y = x W^T + b with W's rows (output features) split: x [.., in] -> [.., out / size].

    `rows` overrides the even split with (start, length), e.g. a replicated KV head."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel,
                 rows: tuple[int, int] | None = None, what: str = "out_features") -> None:
        if rows is None:
            per = tp.split(out_features, what)
            rows = (tp.rank * per, per)
        start, length = rows
        super().__init__(LinearShape(length, in_features, Shard(0, start, length)), Shard(0, start, length), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, self.bias)


class RowParallelLinear(ParallelLinear):
    """y = sum over ranks of x_r W_r^T, + b: x [.., in / size] -> [.., out] (all-reduced)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel,
                 what: str = "in_features") -> None:
        per = tp.split(in_features, what)
        super().__init__(LinearShape(out_features, per, Shard(1, tp.rank * per, per)), None, bias)  # bias replicated
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:  # the fused bias add, bit for bit nn.Linear
            return self.method.apply(self, x, self.bias)
        y = self.tp.all_reduce(self.method.apply(self, x, None))
        return y if self.bias is None else y + self.bias


class FusedLinear(nn.Module):
    """Sibling column-parallel layers with one input (Q/K/V, gate/up) as one: their resident
    weights stacked by output rows, multiplied in one GEMM by their shared method; `sizes`:
    each sibling's outputs, in order."""

    def __init__(self, layers: list[ColumnParallelLinear], tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        first = layers[0]
        self.method, self.sizes = first.method, [layer.shape.out_features for layer in layers]
        self.shape = LinearShape(sum(self.sizes), first.shape.in_features)
        for name in first.method.attrs:
            setattr(self, name, getattr(first, name))
        for name, tensor in tensors.items():
            setattr(self, name, nn.Parameter(tensor, requires_grad=False))
        self.weight_names = list(tensors)
        biases = [layer.bias for layer in layers]
        present = next((b for b in biases if b is not None), None)
        self.bias = None if present is None else nn.Parameter(torch.cat([
            b.detach() if b is not None else present.new_zeros(layer.shape.out_features)
            for b, layer in zip(biases, layers)]), requires_grad=False)  # a missing bias as zeros

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, self.bias)


def fuse_projections(model: nn.Module) -> int:
    """Make each group of sibling projections a module names in `fused_projections` one
    `FusedLinear` on the group's first layer (`project` multiplies by it): one call instead of
    several, each with its own threads' (or kernel launch's) start and end. The siblings' own
    weights are freed. Groups whose methods differ or cannot stack stay apart. Returns the
    number of groups fused."""
    fused = 0
    for module in list(model.modules()):
        for names in getattr(module, "fused_projections", ()):
            layers = [getattr(module, name) for name in names]
            first = layers[0]
            if first.fused is not None or any(not isinstance(layer, ColumnParallelLinear)
                                              or layer.method is not first.method for layer in layers):
                continue
            tensors = first.method.concat(layers)
            if tensors is None:
                continue
            first.fused = FusedLinear(layers, tensors)
            for layer in layers:
                for name in layer.weight_names:
                    setattr(layer, name, nn.Parameter(getattr(layer, name).new_empty(0), requires_grad=False))
                layer.bias = None
            fused += 1
    return fused


def pack_linears(model: nn.Module) -> int:
    """Fuse sibling projections (`fuse_projections`), then repack each linear layer's resident
    weight for its device's fastest matmul where its method has one (`LinearMethod.pack`: oneDNN's
    packed float32 weights on the CPU), and the LM head's where it is float32 and untied. The
    loader must have loaded the weights first. Returns the number of matrices packed."""
    fuse_projections(model)
    packed = sum(module.method.pack(module) for module in model.modules()
                 if isinstance(module, (ParallelLinear, FusedLinear)))
    return packed + sum(module.pack(model) for module in model.modules() if isinstance(module, ParallelLMHead))


def project(x: torch.Tensor, *layers: ColumnParallelLinear) -> tuple[torch.Tensor, ...]:
    """Each of `layers`' outputs for the same input `x`: one matmul when they were fused
    (`fuse_projections`; views of its output's columns), else one call each."""
    fused = layers[0].fused
    if fused is None:
        return tuple(layer(x) for layer in layers)
    return fused(x).split_with_sizes(fused.sizes, dim=-1)  # the C method: Tensor.split is Python


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

    def pack(self, model: nn.Module) -> bool:
        """Pack the weight for oneDNN as a dense layer's (`onednn_packed`), unless another module
        of `model` holds it too (a head tied to the embedding table, which reads its rows).
        True when it did."""
        shared = any(p is self.weight for m in model.modules() if m is not self for p in m.parameters(recurse=False))
        packed = None if shared else onednn_packed(self.weight)
        if packed is not None:
            self.weight = packed
        return packed is not None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.tp.all_gather(linear(hidden, self.weight))  # [R, size * per]
        return logits[:, :self.vocab_size]
