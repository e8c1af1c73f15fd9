"""Whole engines with `attention_backend="triton"` (interpreted on CPU): greedy tokens equal to
the torch backend's, which tests/engine/*parity* hold equal to transformers', for a LLaVA checkpoint
(its CLIP tower at 56 pixels: 17 rows, where the built-in's 577 took a minute interpreted), the
built-in Qwen3-VL and a Qwen2.5-VL checkpoint (window attention). Each runs with a prefix-cache hit and
chunked prefill, so decoder chunks start after cached blocks, and with an image, so the vision
tower attends through the varlen kernel; and with a float16 KV cache under the float32 model.
Also: the CPU default stays torch, and a backend that cannot run is refused at start-up."""

from __future__ import annotations

import pytest
import torch

from mmserve import LLM, SamplingParams
from mmserve.config import ModelConfig
from mmserve.models.attention.backend import attention_backend
from helpers.tiny_models import make_checkpoint, make_image, make_qwen_checkpoint

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
QWEN = ("<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n", "<|vision_start|><|image_pad|><|vision_end|>")
TEMPLATES = {  # (chat template, an image's text) of each family
    "llava": ("USER: {} ASSISTANT:", "<image>\n"),  # a tiny LLaVA whose CLIP tower takes 56-pixel images
    "builtin:tiny-qwen3-vl": QWEN,
    "qwen2.5-vl": QWEN,  # a tiny checkpoint whose 56-pixel image is four windows
}


def run(model: str, path: str, backend: str, **engine_args) -> tuple[list[list[int]], str]:
    """Greedy tokens of two batches (the second's prompt extends one of the first: a prefix hit
    and a chunk after its cached blocks), and the backend the model attended with."""
    llm = LLM(model=path, attention_backend=backend, num_kv_blocks=64, max_num_batched_tokens=128, **engine_args)
    (template, marker), image = TEMPLATES[model], make_image(3, (56, 56))
    first = [{"prompt": template.format(marker + "What is this?"), "multi_modal_data": {"image": image}},
             {"prompt": template.format("a cat and a dog")}]
    second = [{"prompt": template.format(marker + "What is this? Say more about it please"),
               "multi_modal_data": {"image": image}}]
    outs = llm.generate(first, PARAMS) + llm.generate(second, PARAMS)
    llm.engine.core.check_integrity()
    return [o.outputs[0].token_ids for o in outs], llm.engine.core.executor.runner.model.attention.name


@pytest.mark.parametrize("model", list(TEMPLATES))
def test_the_triton_backend_equals_the_torch_backend(model, tmp_path):
    pytest.importorskip("triton")
    if model == "llava":
        path = make_checkpoint(tmp_path, vision_config=dict(image_size=56, patch_size=14))
    else:
        path = model if model.startswith("builtin:") else make_qwen_checkpoint(tmp_path, family="qwen2_5_vl")
    want, torch_name = run(model, path, "torch")
    got, name = run(model, path, "triton")
    assert (name, torch_name) == ("triton", "torch")
    assert got == want


def test_a_16_bit_cache_under_a_float32_model_equals_the_torch_backends():
    """`--kv-cache-dtype float16`: the kernels round K/V as they store them (the rotary write too)
    and widen what they load to q's float32, as the torch backend does."""
    pytest.importorskip("triton")
    want, _ = run("builtin:tiny-qwen3-vl", "builtin:tiny-qwen3-vl", "torch", kv_cache_dtype="float16")
    got, _ = run("builtin:tiny-qwen3-vl", "builtin:tiny-qwen3-vl", "triton", kv_cache_dtype="float16")
    assert got == want


@pytest.mark.slow  # spawns the tensor-parallel workers
def test_tp2_ranks_attend_with_the_engines_backend():
    """Each worker process builds its runner from the config: both ranks run the triton kernels on
    their heads and KV heads, and the tokens are the torch backend's."""
    pytest.importorskip("triton")
    template, marker = QWEN
    image = make_image(3, (56, 56))
    items = [{"prompt": template.format(marker + "What is this?"), "multi_modal_data": {"image": image}}]
    got = {}
    for backend in ("torch", "triton"):
        llm = LLM(model="builtin:tiny-qwen3-vl", attention_backend=backend, tensor_parallel_size=2, num_kv_blocks=64)
        try:
            got[backend] = [o.outputs[0].token_ids for o in llm.generate(items, PARAMS)]
        finally:
            llm.engine.core.shutdown()
    assert got["triton"] == got["torch"]


def test_the_default_on_cpu_is_torch():
    assert ModelConfig().attention_backend == "auto"
    assert attention_backend("auto", torch.device("cpu")).name == "torch"


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # unset on a GPU machine
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        attention_backend("triton", torch.device("cpu"))


def test_a_backend_whose_package_is_missing_is_refused_by_the_config():
    with pytest.raises(ValueError, match="attention_backend"):
        ModelConfig(attention_backend="nonesuch")
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="flashinfer"):
            ModelConfig(attention_backend="flashinfer")


def test_decode_graphs_replay_the_triton_kernel_from_their_static_buffers():
    """The triton backend's `graph_metadata` over the decode graphs' padded static buffers (run
    eagerly: the forward a CUDA graph replays) gives the plain triton engine's tokens. The graphs'
    tables are 32 blocks wide (max_model_len 256), so their decodes run split-KV (2 splits, sized
    in the kernel from each sequence's length) while the plain engine's narrow tables run one."""
    pytest.importorskip("triton")
    from mmserve.models.attention.triton_backend import TritonBackend

    template, _ = TEMPLATES["llava"]  # the built-in LLaVA's template, text only
    items = [{"prompt": template.format("word " * (2 * i + 1))} for i in range(3)]
    params = [SamplingParams(temperature=0.0, max_tokens=2 + 2 * i, ignore_eos=True) for i in range(3)]
    args = dict(model="builtin:tiny-llava", attention_backend="triton", num_kv_blocks=32, block_size=8,
                max_num_seqs=3, max_model_len=256, cuda_graph_sizes=[2, 4])
    plain = [o.outputs[0].token_ids for o in LLM(**args).generate(items, params)]
    llm = LLM(**args)
    runner = llm.engine.core.executor.runner
    runner.allocate_kv_cache(32, scratch=True)
    runner.enable_decode_graphs(TritonBackend.graph_metadata, capture=False)
    assert [o.outputs[0].token_ids for o in llm.generate(items, params)] == plain
    graphs = runner.decode_graphs
    assert graphs is not None and graphs.eager_runs >= 4 and graphs.replays == 0
