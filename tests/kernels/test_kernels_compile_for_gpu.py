"""Every Triton kernel compiled for an H100 / H200 (sm_90) on a machine without a GPU
(`benchmarks/kernel_resources.py`, tests/helpers/gpu_compile.py): the compiler accepts each one at
the shipped models' shapes, each fits the shared memory a block may have, and none spills
registers. The interpreter, which runs every other kernel test here, checks none of this: it ran
the FP8 / int4 kernels with a global the compiler refuses from the day they were written.

Each runs in a subprocess: this process's kernels are interpreted (tests/conftest.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KERNELS = {"_split_decode_kernel", "_reduce_splits_kernel", "_paged_attention_kernel", "_varlen_attention_kernel",
           "_rotary_write_kernel", "_rotary_kernel", "_cache_write_kernel", "_norm_kernel", "_silu_mul_kernel",
           "_quick_gelu_kernel",
           "_gemv_kernel", "_gemm_kernel", "_int8_mm_kernel", "_quant_rows_kernel", "_quant_static_kernel",
           "_fp8_rows_kernel"}


@pytest.fixture(scope="module")
def compiler_env() -> dict[str, str]:
    triton = pytest.importorskip("triton")
    import torch

    if torch.cuda.is_available():  # `make test-gpu`'s minutes are few, and there the kernels compile for real
        pytest.skip("on a GPU every kernel test compiles its kernels for it")
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if not (bin_dir / "ptxas").exists() or not (bin_dir / "cuobjdump").exists():
        pytest.skip("this triton has no ptxas / cuobjdump")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")])
    return env


@pytest.fixture(scope="module")
def report(compiler_env, tmp_path_factory) -> dict:
    """`benchmarks/kernel_resources.py --json`'s report, and its exit code and output."""
    path = tmp_path_factory.mktemp("kernels") / "kernels.json"
    proc = subprocess.run([sys.executable, "benchmarks/kernel_resources.py", "--sass", "--json", str(path)],
                          cwd=ROOT, env=compiler_env, capture_output=True, text=True, timeout=900)
    assert path.exists(), proc.stdout + proc.stderr
    return {**json.loads(path.read_text()), "returncode": proc.returncode, "output": proc.stdout + proc.stderr}


def test_every_kernel_compiles_for_sm90_fits_its_shared_memory_and_spills_nothing(report):
    results = report["kernels"]
    failed = [f"{r['case']}: {r['error']}" for r in results if r["failed"]]
    assert not failed, "\n".join(failed)
    assert {r["kernel"] for r in results} == KERNELS  # every family compiled
    too_big = [(r["case"], r["kernel"], r["shared"]) for r in results if r["shared"] > 227 * 1024]
    assert not too_big
    spilling = [(r["case"], r["kernel"], r["num_warps"], r["num_stages"], r["stack"]) for r in results if r["stack"]]
    assert not spilling, f"(case, kernel, warps, stages, stack bytes a thread): {spilling}"
    assert "0 cases refused" in report["output"]


def test_the_models_steps_compile_whole_and_launch_ten_kernels_a_layer_at_most(report):
    """Qwen2.5-VL-7B's, Qwen3-VL-8B's and LLaVA-1.5-7B's eager decode, prefill and tower on `meta`
    with the triton backend: every launch the model code makes compiles, nothing reads back to the
    host (it could not on `meta`), and each decoder layer and tower block launches at most 10.5
    kernels (4 GEMMs, the fused small ops, attention). Before the towers' small ops went through
    the backend's `LayerOps`, Qwen2.5-VL's tower launched 33 a block; before Qwen3's head norms
    were fused into the rotary + KV write, its decoder 12 a layer."""
    steps = {s["step"]: s for s in report["steps"]}
    kinds = ["decode, batch 1 at 2k", "decode, batch 64 at 2k", "prefill, 1,000 tokens", "tower, one 1024x768 image"]
    models = ("Qwen2.5-VL-7B", "Qwen3-VL-8B", "LLaVA-1.5-7B")
    assert set(steps) == {f"{model} {kind}" for model in models for kind in kinds}
    assert not [s["error"] for s in steps.values() if s["error"]]
    assert report["returncode"] == 0, report["output"]
    for name, step in steps.items():
        assert step["gemms"] >= 4 * step["layers"], name  # the model's projections did run
        assert step["per_layer"] <= 10.5, (name, step)
    for model in ("Qwen2.5-VL-7B", "Qwen3-VL-8B"):
        tower = steps[f"{model} tower, one 1024x768 image"]
        assert tower["triton"]["_rotary_kernel"] == tower["layers"]


def test_attention_kernels_load_whole_vectors(report):
    """No attention kernel loads its rows 2 bytes at a time (`LDG.E.U16`): a head of 72 (Qwen3-VL's
    tower) has a stride the compiler cannot see divides by 8 unless told (`varlen_kernel._head`);
    it loaded every K/V element alone, and unpipelined, before."""
    attention = {"_split_decode_kernel", "_paged_attention_kernel", "_varlen_attention_kernel"}
    narrow = [(r["case"], r["sass"]) for r in report["kernels"]
              if r["kernel"] in attention and "LDG.E.U16" in r["sass"]]
    assert not narrow
    assert all(r["sass"] for r in report["kernels"])  # the disassembly was read


def test_the_quantized_gemv_loads_each_packed_word_once(report):
    """A decode GEMV streams its weight once: a few wide loads a thread per tile (int4 words loaded
    [BLOCK_N, BLOCK_K / 8] and widened in registers, one scale and zero per row when the tile lies
    in one group; int8 codes, a byte a lane, in wide vectors). Loaded per lane before: 49 load
    instructions a thread for the int4 tile."""
    gemv = [r for r in report["kernels"] if r["kernel"] == "_gemv_kernel"]
    assert len(gemv) == 4
    loads = {r["case"]: sum(n for op, n in r["sass"].items() if op.startswith("LDG")) for r in gemv}
    assert all(n <= 8 for n in loads.values()), loads
