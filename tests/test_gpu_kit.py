"""The GPU kit's harness, checked on any machine (not `gpu`-marked: it runs in `make test`): the
references leave transformers as they found it, so every test after them in one process sees
the same library (on a GPU machine with torchvision, a leaked shim broke the CLIP processor);
`make bench-gpu`'s quantized rows (`gpu_serving.py --quantized`) run at a tiny size on the CPU."""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers.image_processing_backends as backends
import transformers.video_processing_utils as video_utils

from helpers.hf_video import hf_video_inputs, hf_video_processor
from helpers.tiny_models import make_qwen_checkpoint
from helpers.tiny_videos import make_frames
from PIL import Image
from safetensors.torch import load_file

WATCHED = ((backends, "tvF"), (backends, "pil_torch_interpolation_mapping"), (video_utils, "tvF"))
ABSENT = object()
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def transformers_state() -> list[object]:
    return [module.__dict__.get(attr, ABSENT) for module, attr in WATCHED]


def test_the_video_reference_leaves_transformers_as_it_found_it(tmp_path):
    before = transformers_state()
    path = make_qwen_checkpoint(tmp_path, family="qwen2_5_vl")
    processor = hf_video_processor(path, "qwen2_5_vl")
    assert transformers_state() == before  # built without leaving anything behind
    for seed in (0, 1):  # works on every call, and leaves nothing after any
        out = hf_video_inputs(processor, make_frames(seed, 4), 2.0)
        assert out["pixel_values_videos"].shape[0] == int(out["video_grid_thw"].prod())
        assert transformers_state() == before


@pytest.fixture(scope="module")
def gpu_bench(tmp_path_factory) -> Iterator[tuple[Any, str]]:
    """benchmarks/_gpu_quant.py (imported from its folder, as its script runs it) and the tiny
    checkpoint `gpu_serving.py --device cpu --tiny` builds."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import _gpu_quant
        from gpu_serving import build_checkpoint

        path = str(tmp_path_factory.mktemp("bench") / "model")
        build_checkpoint(path, tiny=True, device=torch.device("cpu"), dtype=torch.float32)
        yield _gpu_quant, path
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_the_gpu_benchmarks_quantized_copies_take_the_published_layouts(gpu_bench, tmp_path):
    """AWQ: int4 in groups of 128 packed [in, out / 8], float16 scales and every unquantized tensor
    (the tower's too); FP8: e4m3 weights with a float32 `weight_scale_inv` per 128 x 128 block;
    W8A8: compressed-tensors' int-quantized, int8 weights with a scale per row, the tower left out;
    FP8-dynamic: compressed-tensors' float-quantized, per-token activations."""
    quant, path = gpu_bench
    for fmt in quant.QUANT_FORMATS:
        quant.write_copy(path, tmp_path / fmt.name, fmt, torch.device("cpu"))
    configs = {f.name: json.loads((tmp_path / f.name / "config.json").read_text())["quantization_config"]
               for f in quant.QUANT_FORMATS}
    assert list(configs) == ["awq", "fp8", "w8a8", "fp8-dyn"]
    assert configs["fp8-dyn"]["format"] == "float-quantized"
    assert configs["fp8-dyn"]["config_groups"]["group_0"]["input_activations"]["dynamic"] is True
    assert configs["w8a8"]["format"] == "int-quantized" and "re:.*visual.*" in configs["w8a8"]["ignore"]
    assert {k: configs["awq"][k] for k in ("quant_method", "bits", "group_size", "version", "zero_point")} == \
        {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True}
    assert "visual" in configs["awq"]["modules_to_not_convert"]
    assert configs["fp8"]["quant_method"] == "fp8" and configs["fp8"]["weight_block_size"] == [128, 128]
    tensors = {f: load_file(str(tmp_path / f / "model.safetensors")) for f in ("awq", "fp8", "w8a8")}
    mlp = next(name for name in tensors["fp8"] if name.endswith("layers.0.mlp.down_proj.weight")).removesuffix("weight")
    assert tensors["w8a8"][mlp + "weight"].dtype == torch.int8
    assert tensors["w8a8"][mlp + "weight_scale"].shape == (128, 1)
    assert all(t.is_floating_point() for name, t in tensors["w8a8"].items() if "visual" in name)
    assert tensors["awq"][mlp + "qweight"].shape == (256, 128 // 8) and tensors["awq"][mlp + "qweight"].dtype == \
        torch.int32
    assert tensors["awq"][mlp + "scales"].shape == (2, 128) and tensors["awq"][mlp + "scales"].dtype == torch.float16
    assert tensors["fp8"][mlp + "weight"].dtype == torch.float8_e4m3fn
    assert tensors["fp8"][mlp + "weight_scale_inv"].shape == (1, 2)
    packed = ("qweight", "qzeros")
    assert all(t.dtype == torch.float16 for name, t in tensors["awq"].items() if not name.endswith(packed))
    assert all(t.dtype == torch.float32 for name, t in tensors["fp8"].items() if "visual" in name or "lm_head" in name)


def test_the_gpu_benchmarks_quantized_rows_run_on_the_cpu(gpu_bench, capsys):
    """`gpu_serving.py --quantized` at a tiny size: each format's grep-able rows, the bytes its step
    reads below FP8's (AWQ) and the unquantized model's (both), and no copy left on disk."""
    quant, path = gpu_bench
    pictures = [Image.new("RGB", (112, 84), color) for color in ("red", "blue")]
    quant.quantized_report(path, 32, 2, pictures, torch.device("cpu"), torch.float32, bandwidth=1e10)
    out = capsys.readouterr().out
    number = r"(\d+\.\d+)"
    byte_ratios = {}
    for name, target in (("awq", "0.40"), ("fp8", "0.60"), ("w8a8", "0.60"), ("fp8-dyn", "0.60")):
        decode = re.search(rf"quantized decode, batch 1, eager: {name} {number} ms / float32 {number} ms = {number} "
                           rf"\(target <= {target}; bytes {number}\)", out)
        assert decode is not None, out
        assert float(decode[3]) == pytest.approx(float(decode[1]) / float(decode[2]), rel=0.1)
        byte_ratios[name] = float(decode[4])
        assert re.search(rf"quantized TTFT, one new 112x84 image: {name} {number} ms / float32 {number} ms = "
                         rf"{number} \(target <= 1.00\)", out), out
    assert byte_ratios["awq"] < byte_ratios["fp8"] < 1 and byte_ratios["w8a8"] < 1 and byte_ratios["fp8-dyn"] < 1
    assert "failed" not in out
    assert os.listdir(os.path.dirname(path)) == ["model"]


def test_the_attention_sweep_runs_on_the_cpu():
    """`attention_sweep.py --smoke`: every shape's table under Triton's interpreter, each launch the
    current one or one knob away from it, and a best line; nothing refused."""
    import subprocess

    root = BENCHMARKS.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root / "tests")])}
    done = subprocess.run([sys.executable, str(BENCHMARKS / "attention_sweep.py"), "--smoke"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    titles = re.findall(r"^(decode, batch 1|decoder prefill|tower, \d+ rows, full|tower, \d+ rows, \d+ windows)", out,
                        re.MULTILINE)
    assert len(titles) == 4 and out.count("  best: ") == 4, out
    labels = re.findall(r"^ +(\S+(?: \d+x\d+)?) +\d+\.\d us", out, re.MULTILINE)
    assert all(label.startswith(("current", "tile_n=", "num_warps=", "num_stages=", "splits=", "block_m=",
                                 "block_n=")) for label in labels), labels
    assert "refused" not in out and "WRONG" not in out and "splits=2" in out
