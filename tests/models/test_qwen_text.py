"""Our Qwen2 / Qwen3 decoders (`QwenTextModel`) against transformers' `Qwen2_5_VLTextModel` and
`Qwen3VLTextModel` on the same random weights: a 40-token sequence with one image in the middle
(M-RoPE positions from `mrope_positions`), through the paged cache whole, in two prefill chunks
(the first ending inside the image) plus three decode steps, and over two tensor-parallel ranks;
Qwen3-VL with deepstack features on the image rows.

transformers' text models take `position_ids` [3, B, L] (temporal, height, width; the causal mask
then comes from the sequence) or [4, B, L] with the text positions first (used for packed masks).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from mmserve.models.attention.torch_sdpa import AttentionMetadata
from mmserve.models.mrope import mrope_positions
from mmserve.models.parallel import ColumnParallelLinear, pack_linears
from mmserve.models.qwen_config import QwenTextConfig
from mmserve.models.qwen_text import QwenTextModel

pytestmark = pytest.mark.slow  # spawns processes (deselect with -m 'not slow')

IMAGE, START, END = 120, 121, 122
SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, rms_norm_eps=1e-6)
THETA, HEAD_DIM, MERGE = 10000.0, 16, 2
DEEPSTACK = 2  # Qwen3-VL: vision features added after the first two decoder layers
VARIANTS = {  # family, mrope_section, attention_bias (Qwen3: q, k, v and o)
    "qwen2_5": ("qwen2_5_vl", (2, 3, 3), False),
    "qwen3": ("qwen3_vl", (4, 2, 2), False),
    "qwen3-bias": ("qwen3_vl", (2, 3, 3), True),
}


def randomize(module: torch.nn.Module, seed: int = 0, std: float = 0.2) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(module.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=generator) * std)


def build_pair(variant: str, **shape):
    """(transformers' text model with random weights, our config of the same shape)."""
    from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, Qwen3VLTextConfig, Qwen3VLTextModel

    family, section, bias = VARIANTS[variant]
    shape = {**SHAPE, **shape}
    tokens = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)  # Qwen's ids exceed the tiny vocab
    rope = {"rope_type": "default", "rope_theta": THETA, "mrope_section": list(section)}
    if family == "qwen2_5_vl":  # head_dim is hidden_size / heads there
        hf = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(**shape, **tokens, rope_parameters=rope))
    else:
        rope["mrope_interleaved"] = True
        hf = Qwen3VLTextModel(Qwen3VLTextConfig(**shape, **tokens, head_dim=HEAD_DIM, attention_bias=bias,
                                                 rope_parameters=rope))
    randomize(hf.float().eval())
    qwen3 = family == "qwen3_vl"
    cfg = QwenTextConfig(**shape, head_dim=HEAD_DIM, rope_theta=THETA, max_position_embeddings=4096,
                         attention_bias=bias, mlp_bias=False, tie_word_embeddings=False, eos_token_id=None,
                         mrope_section=section, mrope_interleaved=qwen3, qk_norm=qwen3, qkv_bias=not qwen3 or bias)
    return hf, cfg


def sequence(D: int, deepstack: bool, seed: int = 1):
    """40 tokens: 14 text, <|vision_start|>, 12 image pads (a 6x8 grid), <|vision_end|>, 12 text.
    Returns embeds [L, D], positions [3, L], image mask [L], deepstack [Ld, L, D] (or None)."""
    ids = list(range(14)) + [START] + [IMAGE] * 12 + [END] + list(range(20, 32))
    positions, _ = mrope_positions(ids, [(15, 1, 6, 8)], MERGE)
    gen = torch.Generator().manual_seed(seed)
    embeds = torch.randn(len(ids), D, generator=gen)
    mask = torch.tensor(ids) == IMAGE
    features = None
    if deepstack:
        features = torch.zeros(DEEPSTACK, len(ids), D)
        features[:, mask] = torch.randn(DEEPSTACK, int(mask.sum()), D, generator=gen)
    return embeds, positions, mask, features


def hf_hidden(hf, embeds, positions, mask, deepstack) -> torch.Tensor:
    """transformers on the whole sequence (batch of one) -> [L, D]."""
    kwargs = {}
    if deepstack is not None:  # its own layout: the image rows only, one tensor per layer
        kwargs = dict(visual_pos_masks=mask[None], deepstack_visual_embeds=[d[mask] for d in deepstack])
    with torch.no_grad():
        out = hf(inputs_embeds=embeds[None], position_ids=positions[:, None], use_cache=False, **kwargs)
    return out.last_hidden_state[0]


def ours_from(hf, cfg: QwenTextConfig) -> QwenTextModel:
    ours = QwenTextModel(cfg).eval()
    hf_params = dict(hf.named_parameters())
    assert set(dict(ours.named_parameters())) == set(hf_params)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            p.copy_(hf_params[name])
    return ours


def run_paged(model: QwenTextModel, embeds, positions, deepstack, chunks: list[int], block_size: int = 4):
    """The sequence through a paged cache (blocks out of order) in steps of `chunks` tokens -> [L, D]."""
    L, attn = embeds.shape[0], model.layers[0].self_attn
    table = torch.randperm(L // block_size + 2, generator=torch.Generator().manual_seed(3)).tolist()
    shape = (len(table), block_size, model.num_kv_heads, attn.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in model.layers]
    out, start = [], 0
    with torch.no_grad():
        for n in chunks:
            meta = AttentionMetadata.build([n], [start + n], [table], block_size)
            rows = slice(start, start + n)
            ds = None if deepstack is None else deepstack[:, rows]
            out.append(model(embeds[rows], positions[:, rows], caches, meta, ds))
            start += n
    return torch.cat(out)


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request):
    hf, cfg = build_pair(request.param)
    return hf, cfg, ours_from(hf, cfg)


def test_parameter_names_and_kv_heads(pair):
    hf, cfg, ours = pair
    names = set(dict(ours.named_parameters()))
    assert ("layers.0.self_attn.q_norm.weight" in names) == cfg.qk_norm
    assert ("layers.0.self_attn.q_proj.bias" in names) == cfg.qkv_bias
    assert ("layers.0.self_attn.o_proj.bias" in names) == cfg.attention_bias
    assert ours.num_kv_heads == 2 and isinstance(ours.embed_tokens.weight, torch.nn.Parameter)


@pytest.mark.parametrize("chunks", [[40], [25, 12, 1, 1, 1]], ids=["whole", "chunked+decode"])
def test_hidden_states_equal_transformers(pair, chunks):
    hf, cfg, ours = pair
    embeds, positions, mask, deepstack = sequence(cfg.hidden_size, cfg.qk_norm)
    _, delta = mrope_positions([0] * 40, [(15, 1, 6, 8)], MERGE)
    assert positions[:, -3:].tolist() == [list(range(37 + delta, 40 + delta))] * 3  # decode: i + delta
    ref = hf_hidden(hf, embeds, positions, mask, deepstack)
    got = run_paged(ours, embeds, positions, deepstack, chunks)
    # one pass is bit for bit transformers'; chunks attend over the cache with a mask: rounding
    exact = len(chunks) == 1
    torch.testing.assert_close(got, ref, atol=0 if exact else 1e-6, rtol=0 if exact else 1e-6)


def test_deepstack_changes_image_rows_and_what_follows(pair):
    """A guard on the test above: deepstack matters, and only from the first image row on."""
    hf, cfg, ours = pair
    if not cfg.qk_norm:
        pytest.skip("Qwen2.5-VL has no deepstack")
    embeds, positions, _, deepstack = sequence(cfg.hidden_size, True)
    with_ds = run_paged(ours, embeds, positions, deepstack, [40])
    without = run_paged(ours, embeds, positions, None, [40])
    assert torch.equal(with_ds[:15], without[:15]) and not torch.allclose(with_ds[15:], without[15:])


RANK_SCRIPT = """
import sys, torch, torch.distributed as dist
sys.path[:0] = [{tests!r}]
from mmserve.models.parallel import TensorParallel
from mmserve.models.qwen_text import QwenTextModel
from test_qwen_text import run_paged
rank, path = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method="file://" + path + ".store", rank=rank, world_size=2)
outs = []
for cfg, state, embeds, positions, deepstack, chunks in torch.load(path, weights_only=False):
    model = QwenTextModel(cfg, TensorParallel(rank, 2))
    shards = {{f"{{m}}.{{n}}" if m else n: s for m, mod in model.named_modules()
              for n, s in getattr(mod, "tp_shards", {{}}).items()}}
    with torch.no_grad():
        for name, p in model.named_parameters():
            s, full = shards.get(name), state[name]
            full = full if s is None else full.narrow(s.dim, s.start, s.length)
            p.zero_()[tuple(slice(0, n) for n in full.shape)] = full
    outs.append(run_paged(model, embeds, positions, deepstack, chunks))
if rank == 0:
    torch.save(outs, path + ".out")
dist.destroy_process_group()
"""


def test_tensor_parallel_2_equals_transformers(tmp_path):
    """Two gloo ranks (one pair of processes for both cases): Qwen2.5 with its 2 KV heads split,
    Qwen3 (q/k norms, deepstack) with 1 KV head replicated; chunked prefill and a decode step."""
    jobs, refs = [], []
    for variant, kv_heads in [("qwen2_5", 2), ("qwen3", 1)]:
        hf, cfg = build_pair(variant, num_key_value_heads=kv_heads)
        embeds, positions, mask, deepstack = sequence(cfg.hidden_size, cfg.qk_norm)
        refs.append(hf_hidden(hf, embeds, positions, mask, deepstack))
        state = {k: v.detach() for k, v in hf.state_dict().items()}
        jobs.append((cfg, state, embeds, positions, deepstack, [25, 14, 1]))
    path = str(tmp_path / "inputs.pt")
    torch.save(jobs, path)
    script = RANK_SCRIPT.format(tests=os.path.dirname(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    procs = [subprocess.Popen([sys.executable, "-c", script, str(r), path], env=env) for r in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    for got, ref in zip(torch.load(path + ".out"), refs):
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")
@pytest.mark.parametrize("variant", ["qwen2_5", "qwen3-bias"])
def test_packed_and_fused_layers_equal_the_plain_ones(variant):
    """`pack_linears`: oneDNN-packed weights, Q/K/V and gate/up fused into one matrix each, give
    the plain layers' hidden states (prefill chunks and decode steps, with and without biases)."""
    hf, cfg = build_pair(variant)
    model = ours_from(hf, cfg)
    embeds, positions, _, _ = sequence(SHAPE["hidden_size"], deepstack=False)
    chunks = [17, 20, 1, 1, 1]
    plain = run_paged(model, embeds, positions, None, chunks)

    packed = pack_linears(model)  # the runner's on a float32 CPU model

    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert attn.q_proj.fused.sizes == [cfg.num_attention_heads * 16, cfg.num_key_value_heads * 16,
                                       cfg.num_key_value_heads * 16]
    assert mlp.gate_proj.fused.sizes == [cfg.intermediate_size] * 2
    assert attn.k_proj.weight.numel() == 0 and mlp.up_proj.weight.numel() == 0  # freed, not kept twice
    assert (attn.q_proj.fused.bias is not None) == cfg.qkv_bias
    # per layer: Q/K/V and gate/up fused (2), then o_proj and down_proj packed (2)
    assert packed == 4 * cfg.num_hidden_layers
    assert sum(isinstance(m, ColumnParallelLinear) and m.fused is not None for m in model.modules()) \
        == 2 * cfg.num_hidden_layers
    torch.testing.assert_close(run_paged(model, embeds, positions, None, chunks), plain, atol=1e-5, rtol=1e-5)
