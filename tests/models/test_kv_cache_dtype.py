"""`--kv-cache-dtype`: a float32 model's KV cache in float16 or bfloat16.

The C decode kernel's mixed entry points (float32 q and out over a 16-bit cache) equal the float32
kernel run over the cache widened to float32; an engine with a 16-bit cache generates the float32
cache's greedy tokens, with log probabilities near them (and not equal: the cache did round);
a prefix-cache hit reads exactly what the miss attended; `auto` leaves everything as it was; the
cache is allocated and sized in its own dtype; fp8 and unknown names are refused at start.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

from helpers.tiny_models import make_image
from mmserve import LLM, SamplingParams
from mmserve.cli import main
from mmserve.config import EngineConfig
from mmserve.models.attention import cpu_kernels

needs_kernel = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler here")
MODEL = "builtin:tiny-qwen3-vl"
CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
# nats, on the top-3 log probabilities: rounding K/V to bfloat16 (8 bits of mantissa) moves this
# tiny model's by up to ~1.4e-2 (float16, 11 bits: ~2e-3; measured); a cache read at the wrong
# dtype or place moves them by whole nats
TOLERANCE = 5e-2
# a hit against a miss: float32 sum order moves them by ~7e-6 (the float32 cache's too); a hit that
# read rounded K/V where the miss attended its chunk's own unrounded ones, by ~1.3e-3 (float16)
HIT_TOLERANCE = 1e-4


@needs_kernel
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(8, 2, 64), (8, 4, 128), (9, 3, 40), (4, 4, 80)])
def test_the_mixed_kernel_equals_the_float32_kernel_over_the_widened_cache(cache_dtype, splits, heads, kv_heads,
                                                                           head_dim):
    """Equal within float32 sum-order tolerance (not exactly: the mixed entries sum by query head
    pair and vector, `csrc/grouped_16bit.h`); groups of query heads in pairs and an odd one, head
    dims with a tail past the vectors."""
    g = torch.Generator().manual_seed(7)
    block = 8
    seq_lens = [1, 9, 100, 37]
    num_blocks = 40
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[free.pop() for _ in range(-(-n // block))] for n in seq_lens]
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    k_cache, v_cache = (torch.randn(num_blocks, block, kv_heads, head_dim, generator=g).to(cache_dtype)
                        for _ in range(2))
    q = torch.randn(len(seq_lens), heads, head_dim, generator=g)
    rows, lens, scale = torch.arange(len(seq_lens)), torch.tensor(seq_lens), 1 / math.sqrt(head_dim)
    mixed, wide = torch.full_like(q, float("nan")), torch.full_like(q, float("nan"))
    assert cpu_kernels.paged_decode(q, k_cache, v_cache, padded, lens, rows, mixed, scale, splits)
    assert cpu_kernels.paged_decode(q, k_cache.float(), v_cache.float(), padded, lens, rows, wide, scale, splits)
    torch.testing.assert_close(mixed, wide, rtol=1e-5, atol=1e-6)


def _generate(**engine_args) -> tuple[list, LLM]:
    """Greedy outputs of an image prompt, then of a longer prompt that starts with it (a prefix-
    cache hit when caching is on), each in its own batch."""
    llm = LLM(model=MODEL, num_kv_blocks=64, block_size=4, **engine_args)
    first = {"prompt": CHAT.format(IMAGE + "What is this?"), "multi_modal_data": {"image": make_image(3, (56, 56))}}
    second = {"prompt": CHAT.format(IMAGE + "What is this?") + "It is", "multi_modal_data": first["multi_modal_data"]}
    outs = [llm.generate([p], PARAMS)[0].outputs[0] for p in (first, second)]
    llm.engine.core.check_integrity()
    return outs, llm


def _logprob_gap(a, b) -> float:
    """The largest difference of a token's log probability in both outputs, over their steps."""
    return max(abs(x[t].logprob - y[t].logprob) for x, y in zip(a.logprobs, b.logprobs) for t in x.keys() & y.keys())


@pytest.fixture(scope="module")
def float32_cache() -> list:
    return _generate(enable_prefix_caching=False)[0]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_16_bit_cache_generates_the_float32_caches_tokens(dtype, float32_cache):
    """Tokens equal, log probabilities within TOLERANCE and not all equal (the K/V were rounded)."""
    outs, llm = _generate(kv_cache_dtype=dtype, enable_prefix_caching=False)
    runner = llm.engine.core.executor.runner
    assert {t.dtype for pair in runner.kv_caches for t in pair} == {getattr(torch, dtype)}
    assert runner.dtype == torch.float32
    for got, want in zip(outs, float32_cache):
        assert got.token_ids == want.token_ids
        assert 0 < _logprob_gap(got, want) <= TOLERANCE


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_prefix_hit_equals_the_miss_with_a_16_bit_cache(dtype):
    """Caches on and off: equal tokens, and log probabilities equal to float32 sum order (far below
    the K/V rounding): the hit reads the rounded K/V that the miss attended, its own chunk's too."""
    (_, hit), _ = _generate(kv_cache_dtype=dtype)
    (_, miss), _ = _generate(kv_cache_dtype=dtype, enable_prefix_caching=False)
    assert hit.num_cached_tokens > 0 and not miss.num_cached_tokens
    assert hit.token_ids == miss.token_ids
    assert _logprob_gap(hit, miss) <= HIT_TOLERANCE


def test_auto_keeps_the_models_dtype_and_outputs(float32_cache):
    outs, llm = _generate(kv_cache_dtype="auto", enable_prefix_caching=False)
    assert llm.engine.core.executor.runner.kv_caches[0][0].dtype == torch.float32
    for got, want in zip(outs, float32_cache):
        assert got.token_ids == want.token_ids and _logprob_gap(got, want) == 0


def test_blocks_are_sized_by_the_caches_itemsize(caplog):
    """A float32 model's 16-bit cache: half the bytes a block, twice the blocks in the same memory;
    the engine's start line names the cache's dtype."""
    blocks, per_block = {}, {}
    for dtype in ("auto", "float16"):
        with caplog.at_level(logging.INFO, logger="mmserve.engine.core"):
            llm = LLM(model=MODEL, kv_cache_memory_gb=0.01, kv_cache_dtype=dtype)
        ready = [r.getMessage() for r in caplog.records if "engine core ready" in r.getMessage()]
        assert f"in {'float32' if dtype == 'auto' else dtype} (" in ready[-1]
        runner = llm.engine.core.executor.runner
        per_block[dtype] = runner.kv_cache_bytes_per_block()
        blocks[dtype] = runner.kv_caches[0][0].shape[0]
        held = sum(t.numel() * t.element_size() for pair in runner.kv_caches for t in pair)
        assert held == blocks[dtype] * per_block[dtype]
    assert per_block["auto"] == 2 * per_block["float16"]
    assert blocks["float16"] == int(0.01 * 2**30 // per_block["float16"]) >= 2 * blocks["auto"] - 1


@pytest.mark.parametrize("value, words", [("fp8", r"fp8 \(an 8-bit KV cache\) is not supported"),
                                          ("fp8_e5m2", "not supported"),
                                          ("float64", "must be one of auto, float16, bfloat16; got 'float64'")])
def test_fp8_and_unknown_names_are_refused_in_one_line(value, words, capsys):
    with pytest.raises(ValueError, match=words):
        EngineConfig.from_kwargs(kv_cache_dtype=value)
    assert main(["serve", "--port", "0", "--kv-cache-dtype", value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mmserve: error: kv_cache_dtype") and "auto, float16, bfloat16" in err[0]
