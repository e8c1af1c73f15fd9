"""Our Qwen-VL pieces against transformers' on the same random weights: both vision towers
(window / full attention, interpolated position embeddings, deepstack), M-RoPE positions and
rotary, and both decoders over the paged cache in chunks."""

from __future__ import annotations

import pytest
import torch

from mmserve.models.attention.torch_sdpa import AttentionMetadata
from mmserve.models.qwen_config import QWEN2_5_VL, QWEN3_VL, load_qwen_config
from mmserve.models.qwen_text import QwenTextModel
from mmserve.models.mrope import MRotaryEmbedding, mrope_positions
from mmserve.models.qwen2_5_vision import Qwen2_5VisionTower
from mmserve.models.qwen3_vision import Qwen3VisionTower

GRIDS = [(1, 4, 6), (1, 8, 4), (1, 10, 14), (2, 4, 4)]  # one beyond a window, one with two frames
VISION = {
    QWEN2_5_VL: dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=48, patch_size=14,
                     spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1, 3]),
    QWEN3_VL: dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=48, patch_size=16,
                   spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=36,
                   deepstack_visual_indexes=[0, 2]),
}
TEXT = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)
ARCH = {QWEN2_5_VL: "Qwen2_5_VLForConditionalGeneration", QWEN3_VL: "Qwen3VLForConditionalGeneration"}
SECTION = {QWEN2_5_VL: ([2, 3, 3], False), QWEN3_VL: ([4, 2, 2], True)}
IMAGE, START, END = 120, 121, 122


def randomize(module: torch.nn.Module, seed: int = 0, std: float = 0.2) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(module.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=generator) * std)


def hf_model(family: str):
    from transformers import AutoConfig, AutoModelForImageTextToText

    section, interleaved = SECTION[family]
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section, "mrope_interleaved": interleaved}
    config = AutoConfig.for_model(family, vision_config=VISION[family], text_config={**TEXT, "rope_parameters": rope},
                                  image_token_id=IMAGE, vision_start_token_id=START, vision_end_token_id=END)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()
    randomize(model)
    raw = {**config.to_dict(), "architectures": [ARCH[family]]}
    return model, load_qwen_config(raw, "/nonexistent")


@pytest.fixture(scope="module", params=[QWEN2_5_VL, QWEN3_VL])
def pair(request):
    return request.param, *hf_model(request.param)


def test_vision_tower_equals_transformers(pair):
    family, hf, cfg = pair
    ours = (Qwen3VisionTower if family == QWEN3_VL else Qwen2_5VisionTower)(cfg.vision)
    state = hf.model.visual.state_dict()
    assert set(dict(ours.named_parameters())) == set(dict(hf.model.visual.named_parameters()))
    ours.load_state_dict(state, strict=False)
    patches = sum(t * h * w for t, h, w in GRIDS)
    pixels = torch.randn(patches, cfg.vision.patch_dim, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf.model.visual(pixels, grid_thw=torch.tensor(GRIDS))
        embeds, deepstack = ours(pixels, GRIDS)
    torch.testing.assert_close(embeds, ref.pooler_output, atol=1e-5, rtol=1e-5)
    ref_deep = getattr(ref, "deepstack_features", None) or []
    assert len(deepstack) == len(ref_deep) == len(cfg.vision.deepstack_visual_indexes)
    for got, want in zip(deepstack, ref_deep):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def prompt_ids(grids: list[tuple[int, int, int]], merge: int = 2) -> tuple[list[int], list[tuple[int, int, int, int]]]:
    ids, items = [5, 6, 7], []
    for i, (t, h, w) in enumerate(grids):
        ids += [8 + i, START]
        items.append((len(ids), t, h, w))
        ids += [IMAGE] * (t * h * w // merge**2) + [END]
    return ids + [9, 10, 11, 12], items


@pytest.mark.parametrize("grids", [[], [(1, 4, 6)], [(1, 8, 4), (1, 2, 10)]])
def test_mrope_positions_equal_get_rope_index(pair, grids):
    family, hf, cfg = pair
    ids, items = prompt_ids(grids)
    input_ids = torch.tensor([ids])
    kwargs = dict(mm_token_type_ids=(input_ids == IMAGE).int())
    if grids:
        kwargs["image_grid_thw"] = torch.tensor([list(g) for g in grids])
    ref, delta = hf.model.get_rope_index(input_ids, **kwargs)
    ours, our_delta = mrope_positions(ids, items, 2)
    assert torch.equal(ours, ref[:, 0]) and our_delta == int(delta[0])


def test_mrotary_equals_transformers(pair):
    family, hf, cfg = pair
    positions = torch.randint(0, 50, (3, 1, 20))
    x = torch.zeros(1, 20, 16)
    cos, sin = hf.model.language_model.rotary_emb(x, positions)
    t = cfg.text
    rotary = MRotaryEmbedding(t.head_dim, t.rope_theta, t.mrope_section, t.mrope_interleaved)
    ours = rotary(positions[:, 0], torch.float32)
    torch.testing.assert_close(ours[0][:, 0], cos[0])
    torch.testing.assert_close(ours[1][:, 0], sin[0])


def run_paged(model: QwenTextModel, embeds, positions, deepstack, chunks: list[int], block_size: int = 4):
    """The sequence through the paged cache in chunks of the given sizes; hidden states [L, D]."""
    L, t = embeds.shape[0], model.layers[0].self_attn
    blocks = list(range(-(-L // block_size)))
    shape = (len(blocks), block_size, t.num_kv_heads, t.head_dim)
    cache = [(torch.zeros(shape), torch.zeros(shape)) for _ in model.layers]
    out, start = [], 0
    for n in chunks:
        meta = AttentionMetadata.build([n], [start + n], [blocks], block_size)
        ds = None if deepstack is None else deepstack[:, start:start + n]
        out.append(model(embeds[start:start + n], positions[:, start:start + n], cache, meta, ds))
        start += n
    return torch.cat(out)


def test_decoder_equals_transformers_in_chunks(pair):
    family, hf, cfg = pair
    ids, items = prompt_ids([(1, 8, 4)])
    positions, _ = mrope_positions(ids, items, 2)
    L, D = len(ids), cfg.text.hidden_size
    gen = torch.Generator().manual_seed(2)
    embeds = torch.randn(L, D, generator=gen)
    mask = torch.tensor(ids) == IMAGE
    hf_kwargs, deepstack = {}, None
    if family == QWEN3_VL:
        visual = [torch.randn(int(mask.sum()), D, generator=gen) for _ in range(2)]
        deepstack = torch.zeros(2, L, D)
        deepstack[:, mask] = torch.stack(visual)
        hf_kwargs = dict(visual_pos_masks=mask[None], deepstack_visual_embeds=visual)
    ours = QwenTextModel(cfg.text)
    ours.load_state_dict(hf.model.language_model.state_dict(), strict=False)
    with torch.no_grad():
        ref = hf.model.language_model(inputs_embeds=embeds[None], position_ids=positions[:, None],
                                      **hf_kwargs).last_hidden_state[0]
        got = run_paged(ours, embeds, positions, deepstack, [9, L - 9 - 3, 1, 1, 1])
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
