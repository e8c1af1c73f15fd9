"""The GPU benchmark's quantized rows (`gpu_serving.py --quantized`; the leading underscore keeps
`mmserve bench components` from running it): the benchmark's unquantized checkpoint against
quantized copies of itself in the layouts Qwen publishes, each served by its own `LLM` in turn.

- The copies: AWQ int4 (groups of 128, AutoAWQ's GEMM packing, the tensors it leaves unquantized in
  float16, the vision tower left out: as `Qwen/Qwen2.5-VL-7B-Instruct-AWQ`), FP8 block-wise
  (128 x 128 blocks, `weight_scale_inv`, the LM head and the tower left out: as
  `Qwen/Qwen3-VL-8B-Instruct-FP8`) and W8A8 int8 (compressed-tensors' int-quantized, a scale per
  row, the tower and LM head left out: as RedHatAI's `Qwen2.5-VL-7B-Instruct-quantized.w8a8`; its
  decode step at half the bytes against the same target as FP8's) and FP8-dynamic (compressed-tensors'
  float-quantized, a scale per row: RedHatAI's `*-FP8-Dynamic`; on an FP8 GPU `torch._scaled_mm`
  with the activations quantized per token, not the block format's weight-only kernel), written by
  the tests' packer
  (`tests/helpers/quant_checkpoints.py: quantize_checkpoint`) tensor by tensor on the benchmark's
  device, each deleted once its `LLM` is shut down (disk holds the unquantized one and one copy).
- Per model: the batch-1 decode step (CUDA graphs where the engine captured them, at the decode
  sweep's context; `_gpu_decode`), the bytes it must read (`_gpu_decode.decode_read_bytes`)
  against the copy bandwidth, and the time to first token of a new image (median of a few, after
  one warm-up).
- Per format, grep-able lines: its step / the unquantized step against issue 50's targets (AWQ
  <= 0.40, FP8 <= 0.60) beside the ratio of the bytes the two steps read, and its TTFT / the
  unquantized TTFT (target <= 1).

Groups and blocks stay 128 with `--tiny` too: the tiny model's in-features (hidden 128, MLP 256)
are multiples of it.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from _gpu_decode import decode_read_bytes, decode_step_time
from _gpu_limits import sync
from _gpu_requests import first_token_s, with_image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the packer: helpers.quant_checkpoints

GROUP = BLOCK = 128  # Qwen's releases: int4 groups of 128 input columns, FP8 blocks of 128 x 128


@dataclass(frozen=True)
class QuantFormat:
    """A quantized copy the benchmark writes: its name in the report, the packer's format, the dtype
    of the tensors it leaves unquantized (None: the source's) and issue 50's target for its
    decode step / the unquantized step."""

    name: str
    fmt: str
    unquantized: torch.dtype | None
    target: float


QUANT_FORMATS = (QuantFormat("awq", "awq", torch.float16, 0.40), QuantFormat("fp8", "fp8-block", None, 0.60),
                 QuantFormat("w8a8", "w8a8", None, 0.60),
                 QuantFormat("fp8-dyn", "fp8-channel", None, 0.60))  # last: the newest, cut first by the time limit


@dataclass(frozen=True)
class ModelRun:
    """One model's figures: its batch-1 decode step (seconds, "graphs" where CUDA graphs replayed it
    else "eager", bytes it must read), its resident weight bytes, and the median seconds to a new
    image's first token."""

    step_s: float
    mode: str
    step_bytes: int
    weight_bytes: int
    ttft_s: float


def measure(path: str, context: int, steps: int, pictures: list[Any], device: torch.device,
            dtype: torch.dtype) -> ModelRun:
    """The checkpoint at `path` served by an `LLM` on `device`: TTFT of each of `pictures[1:]`
    (after `pictures[0]`, the warm-up) and the batch-1 decode step at `context` cached tokens."""
    from mmserve import LLM

    with LLM(model=path, device=device.type, dtype=str(dtype).removeprefix("torch."), max_num_seqs=1,
             max_model_len=context + 2048, max_num_batched_tokens=16384, cuda_graph_sizes=[1]) as llm:
        first_token_s(llm, [with_image(pictures[0])], device)
        ttft = statistics.median(first_token_s(llm, [with_image(p)], device)[0] for p in pictures[1:])
        core = llm.engine.core
        runner = core.executor.runner
        replays = _replays(runner)
        step = decode_step_time(core, 1, context, steps)
        mode = "graphs" if _replays(runner) > replays else "eager"  # "graphs": the timed steps were replayed
        return ModelRun(step, mode, decode_read_bytes(core, 1, context, steps), runner.model.weight_bytes, ttft)


def _replays(runner: Any) -> int:
    """Decode steps the runner has replayed from its CUDA graphs (0 without any)."""
    return 0 if runner.decode_graphs is None else runner.decode_graphs.replays


def write_copy(path: str, folder: Path, quant: QuantFormat, device: torch.device) -> None:
    """The checkpoint at `path` quantized as `quant` into `folder`, on `device`; says how long it took."""
    from helpers.quant_checkpoints import Recipe, quantize_checkpoint

    start = time.perf_counter()
    quantize_checkpoint(path, folder, Recipe(quant.fmt, GROUP, BLOCK, unquantized=quant.unquantized), device=device)
    sync(device)
    stored = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    print(f"  wrote the {quant.name} copy ({_size(stored)}) in {time.perf_counter() - start:.1f} s, "
          f"quantized on {device.type}", flush=True)


def quantized_run(path: str, quant: QuantFormat, context: int, steps: int, pictures: list[Any],
                  device: torch.device, dtype: torch.dtype) -> ModelRun:
    """`measure` of a copy of `path` quantized as `quant`, written beside it and deleted after."""
    with tempfile.TemporaryDirectory(prefix=f"mmserve-{quant.name}-", dir=Path(path).parent) as root:
        folder = Path(root) / quant.name
        write_copy(path, folder, quant, device)
        return measure(str(folder), context, steps, pictures, device, dtype)


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.2f} MB"


def model_line(name: str, run: ModelRun, bandwidth: float) -> str:
    limit = run.step_bytes / bandwidth
    return (f"  {name:<8} decode step {run.step_s * 1e3:8.2f} ms ({run.mode}), limit {limit * 1e3:7.2f} ms "
            f"({limit / run.step_s:6.1%} of it; {_size(run.step_bytes)} read), weights {_size(run.weight_bytes)}, "
            f"TTFT {run.ttft_s * 1e3:.1f} ms")


def ratio_lines(quant: QuantFormat, run: ModelRun, base_name: str, base: ModelRun, image: str) -> list[str]:
    """The format's grep-able lines: decode step and TTFT, each / the unquantized model's, with targets."""
    mode = run.mode if run.mode == base.mode else f"{run.mode} vs {base.mode}"
    q, b = quant.name, base_name
    return [f"quantized decode, batch 1, {mode}: {q} {run.step_s * 1e3:.2f} ms / {b} {base.step_s * 1e3:.2f} ms = "
            f"{run.step_s / base.step_s:.2f} (target <= {quant.target:.2f}; bytes "
            f"{run.step_bytes / base.step_bytes:.2f})",
            f"quantized TTFT, one new {image} image: {q} {run.ttft_s * 1e3:.1f} ms / {b} {base.ttft_s * 1e3:.1f} ms"
            f" = {run.ttft_s / base.ttft_s:.2f} (target <= 1.00)"]


def quantized_report(path: str, context: int, steps: int, pictures: list[Any], device: torch.device,
                     dtype: torch.dtype, bandwidth: float) -> None:
    """The unquantized checkpoint at `path`, then each of QUANT_FORMATS, measured and compared; a
    format that fails says so in one line and leaves the others' rows."""
    base_name = "bf16" if dtype == torch.bfloat16 else str(dtype).removeprefix("torch.")
    image = "x".join(str(n) for n in pictures[0].size)
    print(f"quantized checkpoints against {base_name} (batch-1 decode step at {context} cached tokens, limit: "
          f"bytes read / copy bandwidth; TTFT: median of {len(pictures) - 1} new {image} images):", flush=True)
    base = measure(path, context, steps, pictures, device, dtype)
    print(model_line(base_name, base, bandwidth), flush=True)
    for quant in QUANT_FORMATS:
        try:
            run = quantized_run(path, quant, context, steps, pictures, device, dtype)
        except Exception as error:  # one format's failure must not hide the next one's rows
            traceback.print_exc()
            print(f"  {quant.name}: failed: {type(error).__name__}: {error}", flush=True)
            continue
        print(model_line(quant.name, run, bandwidth), flush=True)
        print("\n".join(ratio_lines(quant, run, base_name, base, image)), flush=True)
