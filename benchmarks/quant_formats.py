"""The weight formats `decode_step.py` compares: quantized copies of its model in the published
layouts, written once beside it by the tests' packer (tests/helpers/quant_checkpoints.py)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

FORMATS = ("dense", "awq", "w4a16", "w4a16-asym", "fp8-block", "fp8-channel", "fp8-online")


def format_checkpoint(model_dir: str, fmt: str) -> tuple[str, str | None]:
    """(checkpoint, --quantization) of the model in `fmt`: quantized copies are written beside
    it once: int4 in groups of 128, FP8 in 128 x 128 blocks or per row."""
    if fmt in ("dense", "fp8-online"):
        return model_dir, "fp8" if fmt == "fp8-online" else None
    from helpers.quant_checkpoints import quantize_copy

    folder = Path(model_dir).with_name(Path(model_dir).name + "-formats")
    if not (folder / f"{fmt}-q" / "config.json").exists():
        shutil.rmtree(folder / f"{fmt}-q", ignore_errors=True)
        shutil.rmtree(folder / f"{fmt}-deq", ignore_errors=True)
        folder.mkdir(exist_ok=True)
        quantize_copy(model_dir, folder, fmt, group=128, block=128)
        shutil.rmtree(folder / f"{fmt}-deq")
    return str(folder / f"{fmt}-q"), None
