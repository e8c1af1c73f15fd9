"""Our Qwen2-VL, Qwen2.5-VL and Qwen3-VL vision towers against transformers' `model.visual`
(`Qwen2VisionTransformerPretrainedModel`, `Qwen2_5_VisionTransformerPretrainedModel`,
`Qwen3VLVisionModel`) on the same random weights:
images of different grids in one call (one a whole number of windows, two cut short by the grid's
edge, one of two frames), parameter names, Qwen2.5-VL's window order, and two gloo ranks of
tensor parallelism with the fused QKV read as three row ranges.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from mmserve.models.parallel import Shard, TensorParallel
from mmserve.models.qwen2_5_vision import Qwen2_5VisionTower, window_order
from mmserve.models.qwen2_vision import Qwen2VisionTower
from mmserve.models.qwen3_vision import Qwen3VisionTower
from mmserve.models.qwen_config import QWEN2_VL, QwenVisionConfig, load_qwen_config
from mmserve.models.qwen_vision import check_vision_shardable

pytestmark = pytest.mark.slow  # spawns processes (deselect with -m 'not slow')

# merged grids 2x3, 4x2, 5x7, 2x2 (twice): with 2x2-block windows, the first and third are cut short
GRIDS = [(1, 4, 6), (1, 8, 4), (1, 10, 14), (2, 4, 4)]
SHAPE = dict(hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=48, spatial_merge_size=2,
             temporal_patch_size=2)
QWEN2_5 = dict(SHAPE, depth=4, patch_size=14, window_size=56, fullatt_block_indexes=[1, 3])
QWEN3 = dict(SHAPE, depth=4, patch_size=16, num_position_embeddings=64, deepstack_visual_indexes=[0, 2])
# Qwen2-VL's vision config: embed_dim wide, hidden_size out (the decoder's width)
QWEN2 = dict(depth=4, embed_dim=32, mlp_ratio=2, hidden_size=48, num_heads=2, patch_size=14, spatial_merge_size=2,
             temporal_patch_size=2)
TOWERS = {"qwen2": Qwen2VisionTower, "qwen2_5": Qwen2_5VisionTower, "qwen3": Qwen3VisionTower}


def randomize(module: torch.nn.Module, seed: int = 0, std: float = 0.2) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(module.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=generator) * std)


def our_config(c) -> QwenVisionConfig:
    """QwenVisionConfig from a transformers vision config's fields."""
    return QwenVisionConfig(
        depth=c.depth, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_heads=c.num_heads,
        in_channels=c.in_channels, patch_size=c.patch_size, temporal_patch_size=c.temporal_patch_size,
        spatial_merge_size=c.spatial_merge_size, out_hidden_size=c.out_hidden_size, hidden_act=c.hidden_act,
        window_size=getattr(c, "window_size", 0),
        fullatt_block_indexes=tuple(getattr(c, "fullatt_block_indexes", ())),
        num_position_embeddings=getattr(c, "num_position_embeddings", 0),
        deepstack_visual_indexes=tuple(getattr(c, "deepstack_visual_indexes", ())))


def build_hf(family: str):
    """(transformers' tower in float32 with random weights, our config of it)."""
    if family == "qwen2":  # read as mmserve reads a checkpoint's config.json
        from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel
        config = Qwen2VLVisionConfig(**QWEN2)
        hf = Qwen2VisionTransformerPretrainedModel._from_config(config, dtype=torch.float32)
        randomize(hf.eval())
        raw = {"architectures": ["Qwen2VLForConditionalGeneration"], "vision_config": config.to_dict()}
        ours = load_qwen_config(raw, "/nonexistent")
        assert ours.family == QWEN2_VL and ours.vision.intermediate_size == 64 and ours.vision.out_hidden_size == 48
        return hf, ours.vision
    if family == "qwen2_5":
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
        config = Qwen2_5_VLVisionConfig(**QWEN2_5)
        hf = Qwen2_5_VisionTransformerPretrainedModel._from_config(config, dtype=torch.float32)
    else:
        from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel
        config = Qwen3VLVisionConfig(**QWEN3)
        hf = Qwen3VLVisionModel._from_config(config, dtype=torch.float32)
    randomize(hf.eval())
    return hf, our_config(config)


def hf_outputs(hf, pixels: torch.Tensor, grids: list) -> tuple[torch.Tensor, list[torch.Tensor]]:
    with torch.no_grad():
        out = hf(pixels, grid_thw=torch.tensor(grids))
    return out.pooler_output, list(getattr(out, "deepstack_features", None) or [])


def pixels_for(cfg: QwenVisionConfig, grids: list, seed: int = 1) -> torch.Tensor:
    patches = sum(t * h * w for t, h, w in grids)
    return torch.randn(patches, cfg.patch_dim, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=list(TOWERS))
def pair(request):
    return request.param, *build_hf(request.param)


def test_parameter_names_and_shapes_equal_transformers(pair):
    family, hf, cfg = pair
    ours = TOWERS[family](cfg).state_dict()
    theirs = hf.state_dict()
    assert sorted(ours) == sorted(theirs)
    assert {k: tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in theirs.items()}


def test_tower_equals_transformers(pair):
    family, hf, cfg = pair
    ours = TOWERS[family](cfg).eval()
    ours.load_state_dict(hf.state_dict())
    pixels = pixels_for(cfg, GRIDS)
    ref, ref_deep = hf_outputs(hf, pixels, GRIDS)
    with torch.no_grad():
        embeds, deepstack = ours(pixels, GRIDS)
    assert ref.shape == (sum(t * h * w for t, h, w in GRIDS) // 4, 48) and ref.abs().mean() > 0.1
    torch.testing.assert_close(embeds, ref, atol=1e-5, rtol=1e-5)
    assert len(deepstack) == len(ref_deep) == len(cfg.deepstack_visual_indexes)
    for got, want in zip(deepstack, ref_deep):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_images_do_not_see_each_other(pair):
    """An image's rows are the same alone and beside others (attention stays in its image)."""
    family, hf, cfg = pair
    ours = TOWERS[family](cfg).eval()
    ours.load_state_dict(hf.state_dict())
    pixels = pixels_for(cfg, GRIDS)
    with torch.no_grad():
        together, _ = ours(pixels, GRIDS)
        alone, _ = ours(pixels[24:24 + 32], [GRIDS[1]])
    torch.testing.assert_close(together[6:6 + 8], alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("grids", [[(1, 4, 6)], [(1, 8, 8)], [(1, 10, 14), (2, 6, 4)], [(3, 2, 18)]])
def test_window_order_equals_transformers(grids):
    """Our window permutation and `cu` against `get_vision_window_index` (which pads whole
    windows, then drops the padding and the empty windows)."""
    from transformers.vision_utils import get_vision_window_index

    cfg = QwenVisionConfig(**{**QWEN2_5, "fullatt_block_indexes": ()}, in_channels=3, hidden_act="silu")
    order, cu = window_order(grids, cfg)
    ref_order, ref_cu = get_vision_window_index(torch.tensor(grids), 2, cfg.window_size, cfg.patch_size)
    assert torch.equal(order, ref_order) and cu == ref_cu.tolist()


@pytest.mark.parametrize("size, message", [(3, "num_heads"), (2, "intermediate_size")])
def test_check_vision_shardable_names_what_does_not_divide(size, message):
    """(The merger's hidden size, hidden_size * merge_unit, divides whenever the heads do.)"""
    cfg = QwenVisionConfig(**{**QWEN3, "num_heads": 4, "intermediate_size": 63}, in_channels=3,
                           hidden_act="gelu_pytorch_tanh")
    with pytest.raises(ValueError, match=message):
        check_vision_shardable(cfg, TensorParallel(0, size))
    check_vision_shardable(cfg, TensorParallel(0, 1))


def test_pixels_that_do_not_match_the_grids_are_refused():
    cfg = QwenVisionConfig(**QWEN2_5, in_channels=3, hidden_act="silu")
    tower = Qwen2_5VisionTower(cfg)
    with pytest.raises(ValueError, match="pixel_values"):
        tower(torch.zeros(10, cfg.patch_dim), [(1, 4, 4)])
    with pytest.raises(ValueError, match="multiples"):
        tower(torch.zeros(15, cfg.patch_dim), [(1, 3, 5)])


RANK_SCRIPT = """
import sys, torch, torch.distributed as dist
from mmserve.models.parallel import TensorParallel
from mmserve.models.qwen2_5_vision import Qwen2_5VisionTower
from mmserve.models.qwen2_vision import Qwen2VisionTower
from mmserve.models.qwen3_vision import Qwen3VisionTower
rank, path = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method="file://" + path + ".store", rank=rank, world_size=2)

def read(full, s):
    if s is None:
        return full
    if isinstance(s, list):  # the fused qkv: this rank's rows of q, k and v
        return torch.cat([read(full, one) for one in s], dim=s[0].dim)
    return full.narrow(s.dim, s.start, s.length)

outs = []
for family, cfg, state, pixels, grids in torch.load(path, weights_only=False):
    towers = {"qwen2": Qwen2VisionTower, "qwen2_5": Qwen2_5VisionTower, "qwen3": Qwen3VisionTower}
    tower = towers[family](cfg, TensorParallel(rank, 2))
    shards = {f"{m}.{n}" if m else n: s for m, mod in tower.named_modules()
              for n, s in getattr(mod, "tp_shards", {}).items()}
    with torch.no_grad():
        for name, p in tower.named_parameters():
            p.copy_(read(state[name], shards.get(name)))
        outs.append(tower(pixels, grids))
if rank == 0:
    torch.save(outs, path + ".out")
dist.destroy_process_group()
"""


def test_tensor_parallel_2_equals_transformers(tmp_path):
    """Two gloo ranks, one head each: qkv read as three row ranges, MLPs and mergers split."""
    jobs, refs = [], []
    for family in TOWERS:
        hf, cfg = build_hf(family)
        pixels = pixels_for(cfg, GRIDS)
        refs.append(hf_outputs(hf, pixels, GRIDS))
        jobs.append((family, cfg, {k: v.detach() for k, v in hf.state_dict().items()}, pixels, GRIDS))
    path = str(tmp_path / "inputs.pt")
    torch.save(jobs, path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    procs = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(r), path], env=env) for r in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    for (embeds, deepstack), (ref, ref_deep) in zip(torch.load(path + ".out"), refs):
        torch.testing.assert_close(embeds, ref, atol=1e-5, rtol=1e-5)
        assert len(deepstack) == len(ref_deep)
        for got, want in zip(deepstack, ref_deep):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_qkv_shards_are_each_ranks_heads():
    cfg = QwenVisionConfig(**QWEN2_5, in_channels=3, hidden_act="silu")
    qkv = Qwen2_5VisionTower(cfg, TensorParallel(1, 2)).blocks[0].attn.qkv
    assert qkv.weight.shape == (48, 32)
    assert qkv.tp_shards["weight"] == [Shard(0, 16, 16), Shard(0, 48, 16), Shard(0, 80, 16)]
