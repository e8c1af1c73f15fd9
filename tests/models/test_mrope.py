"""M-RoPE against transformers 5.23: `mrope_positions` equals `get_rope_index` (positions and
`rope_deltas`) of tiny Qwen2-VL, Qwen2.5-VL and Qwen3-VL models on prompts built here the way the processor
builds them (`mm_token_type_ids` 1 on image pads, 2 on video pads), and `MRotaryEmbedding` equals
the text rotary embeddings' cos / sin after their M-RoPE recomposition (blocks and interleaved)."""

from __future__ import annotations

import pytest
import torch

from mmserve.models.layers import RotaryEmbedding, apply_rotary
from mmserve.models.mrope import MRotaryEmbedding, frequency_axes, mrope_positions

IMAGE, VIDEO, START, END = 120, 119, 121, 122
MERGE = 2
TINY_TEXT = dict(vocab_size=128, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16)
TINY_VISION = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=1, out_hidden_size=32,
                   spatial_merge_size=MERGE, patch_size=14)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def hf(request):
    """A tiny HF `Qwen2VLModel` / `Qwen2_5_VLModel` / `Qwen3VLModel`: `get_rope_index` reads its config."""
    from transformers import AutoConfig, AutoModel

    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    vision = TINY_VISION if request.param != "qwen2_vl" else dict(  # Qwen2-VL names its width embed_dim
        depth=1, embed_dim=16, hidden_size=32, mlp_ratio=1, num_heads=1, spatial_merge_size=MERGE, patch_size=14)
    config = AutoConfig.for_model(request.param, vision_config=vision,
                                  text_config={**TINY_TEXT, "rope_parameters": rope}, image_token_id=IMAGE,
                                  video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
    return AutoModel.from_config(config).eval()


def build_prompt(grids: list[tuple[int, int, int]], lead: int = 3, tail: int = 4, pad: int = IMAGE):
    """Text, then per item `<|vision_start|>` pads `<|vision_end|>` and a word; returns
    (ids, items as (offset, t, h, w), mm_token_type_ids)."""
    ids, items = list(range(5, 5 + lead)), []
    for i, (t, h, w) in enumerate(grids):
        ids.append(START)
        items.append((len(ids), t, h, w))
        ids += [pad] * (t * h * w // MERGE**2) + [END, 40 + i]
    ids += list(range(60, 60 + tail))
    types = [1 if i == IMAGE else 2 if i == VIDEO else 0 for i in ids]
    return ids, items, torch.tensor([types])


def hf_rope_index(hf, ids: list[int], types: torch.Tensor, grids, key: str = "image_grid_thw", **extra):
    kwargs = {key: torch.tensor([list(g) for g in grids])} if grids else {}
    return hf.get_rope_index(torch.tensor([ids]), mm_token_type_ids=types, **kwargs, **extra)


@pytest.mark.parametrize("grids", [[], [(1, 4, 4)], [(1, 4, 6), (1, 10, 2)], [(1, 2, 8), (1, 6, 6), (1, 2, 2)]])
def test_positions_equal_get_rope_index(hf, grids):
    merge = hf.config.vision_config.spatial_merge_size
    ids, items, types = build_prompt(grids)
    if not grids:  # transformers needs a vision item: text alone is 0..L-1, delta 0
        ours, delta = mrope_positions(ids, [], merge)
        assert torch.equal(ours, torch.arange(len(ids)).expand(3, -1)) and delta == 0
        return
    ref, ref_delta = hf_rope_index(hf, ids, types, grids)
    ours, delta = mrope_positions(ids, items, merge)
    assert ours.dtype == torch.int64 and ours.shape == (3, len(ids))
    assert torch.equal(ours, ref[:, 0]), (ours, ref[:, 0])
    assert delta == int(ref_delta[0, 0])


@pytest.mark.parametrize("lead,tail", [(0, 3), (3, 0), (0, 0)])
def test_positions_at_the_prompt_edges(hf, lead, tail):
    """An image as the first or the last tokens (no `<|vision_start|>` before / after it)."""
    ids, items, types = build_prompt([(1, 6, 4)], lead, tail)
    if lead == 0:  # drop the START too: the image opens the prompt
        ids, types, items = ids[1:], types[:, 1:], [(o - 1, *g) for o, *g in items]
    if tail == 0:  # drop END and the word: the image closes it
        ids, types = ids[:-2], types[:, :-2]
    ref, ref_delta = hf_rope_index(hf, ids, types, [(1, 6, 4)])
    ours, delta = mrope_positions(ids, items, MERGE)
    assert torch.equal(ours, ref[:, 0]) and delta == int(ref_delta[0, 0])


def test_qwen2_video_temporal_step_is_one(hf):
    """Qwen2-VL video: the temporal index steps 1 per group, whatever the frame rate (the model's
    `mrope_positions` gives it step 1.0; spatial extent larger than the temporal one)."""
    if hf.config.model_type != "qwen2_vl":
        pytest.skip("Qwen2-VL's rule")
    grids = [(3, 8, 12)]
    ids, items, types = build_prompt(grids, pad=VIDEO)
    ref, ref_delta = hf_rope_index(hf, ids, types, grids, key="video_grid_thw")
    ours, delta = mrope_positions(ids, items, MERGE, temporal_steps=[1.0])
    assert torch.equal(ours, ref[:, 0]) and delta == int(ref_delta[0, 0])


def test_qwen2_5_video_temporal_step(hf):
    """Qwen2.5-VL video: temporal index * tokens_per_second * second_per_grid_ts (spatial extent
    larger than the temporal one, where 5.23 and the original agree on the text after it)."""
    if hf.config.model_type != "qwen2_5_vl":
        pytest.skip("Qwen2.5-VL's rule (Qwen3-VL splits a video into t = 1 grids: the image case)")
    grids, seconds = [(4, 8, 12)], 0.3  # step 1.2 (tokens_per_second 4): 0, 1, 2, 3
    ids, items, types = build_prompt(grids, pad=VIDEO)
    ref, ref_delta = hf_rope_index(hf, ids, types, grids, key="video_grid_thw",
                                   second_per_grid_ts=torch.tensor([seconds]))
    step = hf.config.vision_config.tokens_per_second * seconds
    ours, delta = mrope_positions(ids, items, MERGE, temporal_steps=[step])
    assert torch.equal(ours, ref[:, 0]) and delta == int(ref_delta[0, 0])


def test_text_after_a_long_video_resumes_past_its_largest_position():
    """The original rule (and vLLM's): max + 1, where 5.23 would resume at start + max(h, w) / merge."""
    ids, items, _ = build_prompt([(4, 2, 2)], lead=2, tail=2, pad=VIDEO)
    positions, delta = mrope_positions(ids, items, MERGE, temporal_steps=[2.0])
    start = 3  # two words and <|vision_start|>
    assert positions[0, start:start + 4].tolist() == [start, start + 2, start + 4, start + 6]
    assert positions[:, start + 4].tolist() == [start + 7] * 3  # <|vision_end|>
    assert delta == int(positions.max()) + 1 - len(ids)


def test_bad_items_are_refused():
    with pytest.raises(ValueError, match="overlaps"):
        mrope_positions([0] * 20, [(2, 1, 4, 4), (4, 1, 4, 4)], MERGE)
    with pytest.raises(ValueError, match="past the prompt"):
        mrope_positions([0] * 5, [(2, 1, 4, 4)], MERGE)
    with pytest.raises(ValueError, match="spatial_merge_size"):
        mrope_positions([0] * 20, [(2, 1, 3, 4)], MERGE)


def hf_rotary(family: str, section: list[int], interleaved: bool):
    from transformers import Qwen2_5_VLTextConfig, Qwen3VLTextConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    rope = {"rope_type": "default", "rope_theta": 1000.0, "mrope_section": section, "mrope_interleaved": interleaved}
    if family == "qwen2_5_vl":
        return Qwen2_5_VLRotaryEmbedding(Qwen2_5_VLTextConfig(**TINY_TEXT, rope_parameters=rope))
    return Qwen3VLTextRotaryEmbedding(Qwen3VLTextConfig(**TINY_TEXT, rope_parameters=rope))


# transformers decides the layout by family: Qwen2.5-VL blocks, Qwen3-VL interleaved
@pytest.mark.parametrize("family,section,interleaved", [
    ("qwen2_5_vl", [2, 3, 3], False), ("qwen2_5_vl", [4, 2, 2], False),
    ("qwen3_vl", [2, 3, 3], True), ("qwen3_vl", [4, 2, 2], True),
])
def test_rotary_equals_transformers(family, section, interleaved):
    from transformers.models.qwen3_vl.modeling_qwen3_vl import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 3000, (3, 1, 37), generator=gen)
    ref_cos, ref_sin = hf_rotary(family, section, interleaved)(torch.zeros(1, 37, 16), positions)  # [1, T, Dh]
    ours = MRotaryEmbedding(16, 1000.0, section, interleaved)
    cos, sin = ours(positions[:, 0], torch.float32)  # [T, 1, Dh]
    assert torch.equal(cos[:, 0], ref_cos[0]) and torch.equal(sin[:, 0], ref_sin[0])
    q = torch.randn(1, 2, 37, 16, generator=gen)  # [B, H, T, Dh] as transformers lays it out
    ref_q, _ = apply_rotary_pos_emb(q, q, ref_cos, ref_sin)
    assert torch.equal(apply_rotary(q[0].transpose(0, 1), cos, sin), ref_q[0].transpose(0, 1))


def test_rotary_of_1d_positions_is_plain_rope():
    positions = torch.arange(50)
    for interleaved in (False, True):
        got = MRotaryEmbedding(16, 1e6, (2, 3, 3), interleaved)(positions, torch.float32)
        want = RotaryEmbedding(16, 1e6)(positions, torch.float32)
        assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_frequency_axes():
    assert frequency_axes((2, 3, 3), False).tolist() == [0, 0, 1, 1, 1, 2, 2, 2]
    assert frequency_axes((2, 3, 3), True).tolist() == [0, 1, 2, 0, 1, 2, 0, 1]
    assert frequency_axes((24, 20, 20), True)[57:].tolist() == [0, 1, 2, 0, 0, 0, 0]
