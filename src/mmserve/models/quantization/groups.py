"""What the integer formats with a scale and zero point per group of input columns share (int4.py,
int8.py): a rank's slice of their packed tensors (GPTQ's, compressed-tensors'), the order
act-order checkpoints quantized their input columns in, and siblings' tensors stacked for one GEMM.

Act-order (GPTQ's `desc_act: true`, compressed-tensors' `actorder: "group"`): GPTQ quantizes W's
input columns in the order of its Hessian's diagonal, group after group, so each group is a
scattered set of `group` columns, which `g_idx` names (each column's group). The resident form
holds the columns sorted by group, which makes every group a run again, and `perm`, the order:
resident column p is W's column perm[p]. A step gathers x's columns by it before the product
(exllama's and vLLM's `g_idx` sort): one gather of the activations per layer.
"""

from __future__ import annotations

import torch

from mmserve.models.quantization.base import Layer, LinearShape, Shard, input_scale, register


def along(shard: Shard | None, dim: int, unit: int = 1) -> Shard | None:
    """The rank's slice of W's split axis as a shard of a tensor holding that axis on `dim`,
    `unit` of W's rows or columns per entry (a packed word, a group)."""
    return None if shard is None else Shard(dim, shard.start // unit, shard.length // unit)


def check_aligned(shard: Shard | None, unit: int) -> None:
    if shard is not None and (shard.start % unit or shard.length % unit):
        raise ValueError(f"a tensor-parallel shard [{shard.start}, {shard.start + shard.length}) of a quantized "
                         f"weight does not start and end on its packing unit ({unit})")


def register_gptq(layer: Layer, shape: LinearShape, group: int, per_word: int, whole_rows: bool) -> None:
    """GPTQ's tensors as AutoGPTQ packs them (W^T: input rows on dim 0, output columns on dim 1),
    `per_word` codes to an int32 (8 at 4 bits, 4 at 8): `qweight` [in / per_word, out], `qzeros`
    [in / group, out / per_word], `scales` [in / group, out], `g_idx` [in], each with this rank's
    slice; `whole_rows` (one group per row): the groups' tensors whole on every rank."""
    out, inp, s = shape.out_features, shape.in_features, shape.shard
    by_out = s is not None and s.dim == 0
    check_aligned(s, per_word if by_out else group)
    per_group = None if whole_rows else along(s, 0, group)
    register(layer, "qweight", (inp // per_word, out), torch.int32, along(s, 1) if by_out else along(s, 0, per_word))
    register(layer, "qzeros", (inp // group, out // per_word), torch.int32,
             along(s, 1, per_word) if by_out else per_group)
    register(layer, "scales", (inp // group, out), torch.float32, along(s, 1) if by_out else per_group, keep_dtype=True)
    register(layer, "g_idx", (inp,), torch.int32, None if by_out else along(s, 0))


def register_packed(layer: Layer, shape: LinearShape, group: int, per_word: int, whole_rows: bool,
                    symmetric: bool, act_order: bool) -> None:
    """compressed-tensors' pack-quantized tensors (W4A16 at 8 codes to an int32, W8A16 at 4),
    each with this rank's slice: `weight_packed` int32 [out, in / per_word], `weight_scale` [out, in
    / group], `weight_shape` [2]; asymmetric: `weight_zero_point` int32 [out / per_word, in / group]
    (packed along rows); `act_order`: `weight_g_idx` [in]; `whole_rows` (one group per row): the
    scales and zero points whole on every rank of a row-parallel layer."""
    out, inp, s = shape.out_features, shape.in_features, shape.shard
    by_out = s is not None and s.dim == 0
    check_aligned(s, per_word if by_out else group)
    per_group = along(s, 0) if by_out else None if whole_rows else along(s, 1, group)
    register(layer, "weight_packed", (out, inp // per_word), torch.int32,
             along(s, 0) if by_out else along(s, 1, per_word))
    register(layer, "weight_scale", (out, inp // group), torch.float32, per_group, keep_dtype=True)
    register(layer, "weight_shape", (2,), torch.int64)
    if not symmetric:
        register(layer, "weight_zero_point", (out // per_word, inp // group), torch.int32,
                 along(s, 0, per_word) if by_out else per_group)
    if act_order:
        register(layer, "weight_g_idx", (inp,), torch.int32, None if by_out else along(s, 0))


def group_order(g_idx: torch.Tensor, group: int, groups: int) -> torch.Tensor | None:
    """None where `g_idx` (each of this rank's input columns' group) puts each run of `group`
    columns in one group, in order; else (act-order) `perm`, the order of the input columns that
    makes the groups runs. ValueError where no order can: groups of other sizes, or groups beyond
    the `groups` this rank holds (a tensor-parallel split of an act-order layer's input columns)."""
    g = g_idx.to(torch.int64)
    runs = torch.arange(g.shape[0], device=g.device) // group
    if not g.numel() or torch.equal(g - g[0], runs):
        return None
    perm = torch.sort(g, stable=True).indices
    if int(g.min()) < 0 or int(g.max()) >= groups or not torch.equal(g[perm], runs):
        raise ValueError(f"a quantized layer's g_idx does not give each of its {groups} groups {group} input "
                         "columns (act-order with tensor parallelism across input columns is not supported: use "
                         "--tensor-parallel-size 1, or a checkpoint quantized without act-order)")
    return perm


def unsorted(w: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:
    """W [out, in] in its own column order from the resident (sorted) order."""
    if perm is None:
        return w
    out = torch.empty_like(w)
    out[:, perm] = w
    return out


def gathered(x: torch.Tensor, layer: Layer) -> torch.Tensor:
    """x with its columns in the layer's resident order (itself where the layer holds no `perm`)."""
    perm = getattr(layer, "perm", None)
    return x if perm is None else x.index_select(-1, perm)


def stack(layers: list[Layer], names: tuple[str, ...]) -> dict[str, torch.Tensor] | None:
    """Sibling layers' tensors `names` stacked by output rows, with their `perm`; None where their
    column orders differ (act-order siblings share one where they share an input: one Hessian)."""
    perm = getattr(layers[0], "perm", None)
    for layer in layers:
        other = getattr(layer, "perm", None)
        if other is None or perm is None:
            if other is not perm:
                return None
        elif not torch.equal(other, perm):
            return None
    stacked = {name: torch.cat([getattr(layer, name) for layer in layers]) for name in names}
    return stacked if perm is None else {**stacked, "perm": perm}


def stack_row_scaled(layers: list[Layer], static_input: bool) -> dict[str, torch.Tensor] | None:
    """Siblings of a per-row scaled method (FP8, W8A8) stacked: `weight` and `scale` by output rows,
    and with `static_input` their one `input_scale`."""
    stacked = stack(layers, ("weight", "scale"))
    return stacked if stacked is None or not static_input else {**stacked, "input_scale": input_scale(layers)}
