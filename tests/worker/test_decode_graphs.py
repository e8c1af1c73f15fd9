"""The decode graphs' static buffers and padding, checked on CPU: plain decode steps run through
`DecodeGraphs` eagerly (the forward a CUDA graph would replay, on the same padded buffers) and
every request's tokens equal a normal engine's, for batch sizes between the captured ones."""

from __future__ import annotations

import pytest

from mmserve import LLM, SamplingParams
from mmserve.config import DeviceConfig
from mmserve.worker.cuda_graphs import torch_decode_metadata
from helpers.tiny_models import make_checkpoint, make_image, make_qwen_checkpoint

LLAVA = "USER: <image>\nWhat is this? {}ASSISTANT:"
QWEN = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is this? {}<|im_end|>\n"


def test_graph_sizes_default_to_powers_then_multiples_of_eight():
    assert DeviceConfig().graph_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert DeviceConfig().graph_sizes(5) == [1, 2, 4, 5]
    assert DeviceConfig().graph_sizes(12) == [1, 2, 4, 8, 12]
    assert DeviceConfig(cuda_graph_sizes=[4, 2, 4]).graph_sizes(64) == [2, 4]
    with pytest.raises(ValueError):
        DeviceConfig(cuda_graph_sizes=[0])


def _requests(template: str) -> list[dict]:
    """Seven requests of different lengths (so contexts span different block counts)."""
    return [{"prompt": template.format("word " * (3 * i)), "multi_modal_data": {"image": make_image(i % 3)}}
            for i in range(7)]


def _params() -> list[SamplingParams]:
    """Greedy and seeded sampling, with different lengths: the batch shrinks 7 -> 1 as they end."""
    return [SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=3 + i, ignore_eos=True,
                           presence_penalty=0.3 * (i % 3)) for i in range(7)]


@pytest.mark.parametrize("family", ["llava", "qwen2_5_vl", "qwen3_vl"])
def test_decode_through_padded_static_buffers_equals_the_plain_engine(tmp_path, family):
    model = make_checkpoint(tmp_path) if family == "llava" else make_qwen_checkpoint(tmp_path, family=family)
    template = LLAVA if family == "llava" else QWEN
    args = dict(max_model_len=256, num_kv_blocks=96, block_size=4, max_num_seqs=7, cuda_graph_sizes=[2, 4, 8])
    plain = LLM(model=model, **args).generate(_requests(template), _params())
    llm = LLM(model=model, **args)
    runner = llm.engine.core.executor.runner
    runner.allocate_kv_cache(96, scratch=True)  # the scratch block padding rows write: id 96, not the scheduler's
    runner.enable_decode_graphs(torch_decode_metadata, capture=False)
    graphed = llm.generate(_requests(template), _params())
    assert [o.outputs[0].token_ids for o in graphed] == [o.outputs[0].token_ids for o in plain]
    graphs = runner.decode_graphs
    assert graphs is not None and graphs.eager_runs >= 6 and graphs.replays == 0
    assert graphs.max_blocks == 64  # 256 tokens of 4-token blocks
    # the last steps decode the longest request alone, in the size-2 graph: row 1 is padding
    assert bool((graphs.block_tables[1] == 96).all()) and int(graphs.seq_lens[1]) == 1
    assert int(graphs.slot_mapping[1]) == 96 * 4
