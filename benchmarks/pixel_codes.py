"""An image's processing in P0 and its bytes downstream: pixel codes against float32 pixel values.

Per image size, for Qwen2.5-VL-7B's and LLaVA-1.5-7B's published processor settings:
- P0 time of mmserve's `process_image` (the processor's geometry on uint8: `pixel_codes`) against
  the transformers processor that makes float32 `pixel_values` (what P0 ran before), as a ratio;
- the item's bytes (what every cache, the shm store and the copy to the device carry), as a ratio;
- the worker's lookup of the values (`pixel_values`) on the CPU, and on CUDA where there is one;
- P0's whole work on requests with new 1024x768 images: one, and four in one request against four
  requests of one (a request's misses are processed together);
- the resize alone (most of Qwen's processing): ours (multimodal/resample.py) against Pillow's;
- a PNG's decoding (a screenshot, a photo): ours (multimodal/png.py) against Pillow's.
The values, the resized bytes and the decoded pixels are checked equal to the transformers
processor's and Pillow's in the same run. The process keeps freed memory for reuse, as P0 does (malloc_tuning.py).

Run: `python benchmarks/pixel_codes.py` (about 30 s on 2 cores).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _model_sizes import LLAVA_15_7B_TEXT, LLAVA_15_7B_VISION, QWEN25_VL_7B_TEXT, QWEN25_VL_7B_VISION  # noqa: E402

from mm_cache import timed as median_s  # noqa: E402
from mmserve.ipc.pixel_codes import pixel_values  # noqa: E402
from mmserve.malloc_tuning import retain_freed_memory  # noqa: E402

SIZES = ((448, 448), (1024, 768), (1920, 1080))  # width x height


def photo(size: tuple[int, int], seed: int = 0) -> Image.Image:
    """A smooth RGB picture (a photo's statistics, unlike noise)."""
    base = np.random.default_rng(seed).integers(0, 256, (12, 16, 3), dtype=np.uint8)
    return Image.fromarray(base).resize(size, Image.Resampling.BILINEAR)


def processors(folder: Path) -> dict[str, tuple[Any, Callable[[Image.Image], torch.Tensor]]]:
    """name -> (mmserve's processor, the transformers call that gives float32 pixel values)."""
    from transformers import AutoProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from mmserve.models.builtin import write_llava_files
    from mmserve.models.builtin_qwen_vl import write_qwen_vl_files
    from mmserve.multimodal.processing import create_processor

    qwen, llava = folder / "qwen2_5_vl", folder / "llava"
    configs = {"Qwen2_5_VLForConditionalGeneration": (qwen, write_qwen_vl_files(
        qwen, family="qwen2_5_vl", text_config=QWEN25_VL_7B_TEXT, vision_config=QWEN25_VL_7B_VISION,
        min_pixels=56 * 56, max_pixels=28 * 28 * 1280)),
        "LlavaForConditionalGeneration": (llava, write_llava_files(llava, text_config=LLAVA_15_7B_TEXT,
                                                                   vision_config=LLAVA_15_7B_VISION))}
    for architecture, (path, config) in configs.items():
        config.architectures = [architecture]
        config.save_pretrained(path)
    ours_qwen, ours_llava = create_processor(str(qwen)), create_processor(str(llava))
    hf_qwen = Qwen2VLImageProcessorPil.from_pretrained(str(qwen))
    hf_llava = AutoProcessor.from_pretrained(str(llava)).image_processor
    return {"Qwen2.5-VL": (ours_qwen, lambda im: hf_qwen(images=[im], return_tensors="pt")["pixel_values"]),
            "LLaVA-1.5": (ours_llava, lambda im: hf_llava(images=[im], return_tensors="pt")["pixel_values"][0])}


def row(name: str, size: tuple[int, int], ours: Any, hf: Callable[[Image.Image], torch.Tensor], runs: int) -> str:
    image = photo(size)
    data, floats = ours.process_image(image), hf(image)
    if not torch.equal(pixel_values(data), floats):
        raise AssertionError(f"{name} {size}: the looked-up values differ from the processor's")
    before, after = median_s(lambda: hf(image), runs), median_s(lambda: ours.process_image(image), runs)
    item_bytes = sum(t.nbytes for t in data.values() if t.is_floating_point() or t.dtype == torch.uint8)
    lookup = median_s(lambda: pixel_values(data), runs)
    cuda = ""
    if torch.cuda.is_available():
        on_gpu = {k: v.cuda() for k, v in data.items()}
        torch.cuda.synchronize()
        cuda = f"  lookup on CUDA {_cuda_s(lambda: pixel_values(on_gpu)) * 1e6:6.0f} us"
    return (f"{name:11} {size[0]:4}x{size[1]:<4}  P0 {after * 1e3:6.1f} ms vs {before * 1e3:6.1f} ms  "
            f"ratio {after / before:4.2f}  bytes {item_bytes / 1e6:6.2f} MB vs {floats.nbytes / 1e6:6.2f} MB  "
            f"ratio {item_bytes / floats.nbytes:4.2f}  lookup on CPU {lookup * 1e3:5.1f} ms{cuda}")


def _cuda_s(fn: Callable[[], Any], runs: int = 20) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(runs):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / runs


def request_rows(path: str, runs: int) -> str:
    """P0's whole work (`InputProcessor.process`: hash, processor, placeholders) on requests with
    new 1024x768 images, on the Qwen2.5-VL checkpoint: one image; four in one request against
    four requests of one, one after another (the request's misses are processed together)."""
    from mmserve.config import EngineConfig
    from mmserve.frontend.input_processor import InputProcessor
    from mmserve.sampling_params import SamplingParams

    inputs = InputProcessor(EngineConfig.from_kwargs(model=path, mm_processor_cache_gb=0), path, 32768, None)
    vision = "<|vision_start|><|image_pad|><|vision_end|>"
    text = "<|im_start|>user\n{}Compare.<|im_end|>\n<|im_start|>assistant\n"
    prompts = iter([{"prompt": text.format(vision * count),  # made before the clock, each image new
                     "multi_modal_data": {"image": [photo((1024, 768), 1000 * count + 100 * run + i)
                                                    for i in range(count)]}}
                    for count in (1, 4) for run in range(runs + 1)])

    def process() -> None:
        pending: list[Any] = []
        inputs.process("r", next(prompts), SamplingParams(max_tokens=1), pending)
        inputs.reject(pending)

    one, four = median_s(process, runs), median_s(process, runs)
    return (f"P0 of a request, Qwen2.5-VL, new 1024x768 images: one {one * 1e3:.1f} ms; four in one request "
            f"{four * 1e3:.1f} ms vs four requests one after another {4 * one * 1e3:.1f} ms  "
            f"ratio {four / one / 4:.2f}")


def resize_row(size: tuple[int, int], runs: int) -> str:
    """Qwen2.5-VL-7B's resize of one image (bicubic, to `smart_resize`'s size): ours against Pillow's."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    from mmserve.multimodal.resample import library, resize_rgb

    image = photo(size)
    height, width = smart_resize(size[1], size[0], 28, 56 * 56, 28 * 28 * 1280)
    pillow = np.asarray(image.resize((width, height), Image.Resampling.BICUBIC))
    if library() is None or not np.array_equal(resize_rgb(image, (width, height), Image.Resampling.BICUBIC), pillow):
        raise AssertionError(f"{size}: our resize is not had, or differs from Pillow's")
    ours = median_s(lambda: resize_rgb(image, (width, height), Image.Resampling.BICUBIC), runs)
    theirs = median_s(lambda: np.array(image.resize((width, height), Image.Resampling.BICUBIC)), runs)
    return (f"resize {size[0]:4}x{size[1]:<4} -> {width}x{height}: ours {ours * 1e3:5.2f} ms vs Pillow "
            f"{theirs * 1e3:5.2f} ms  ratio {ours / theirs:4.2f}")


def screenshot(size: tuple[int, int]) -> Image.Image:
    """A user interface's statistics: flat panels, boxes and text."""
    from PIL import ImageDraw

    image = Image.new("RGB", size, (240, 240, 240))
    draw, rng = ImageDraw.Draw(image), np.random.default_rng(0)
    for _ in range(300):
        x, y = int(rng.integers(0, size[0] - 200)), int(rng.integers(0, size[1] - 30))
        box = [x, y, x + int(rng.integers(20, 200)), y + int(rng.integers(5, 30))]
        draw.rectangle(box, fill=tuple(int(v) for v in rng.integers(0, 256, 3)))
    for i in range(200):
        place = (int(rng.integers(0, size[0] - 100)), int(rng.integers(0, size[1] - 20)))
        draw.text(place, f"Item {i}", fill=(0, 0, 0))
    return image


def png_row(name: str, image: Image.Image, level: int, runs: int) -> str:
    """One PNG's decoding to its pixels: ours against Pillow's (`Image.open(...).load()`)."""
    import io

    from mmserve.multimodal.png import decode_png

    buffer = io.BytesIO()
    image.save(buffer, "PNG", compress_level=level)
    data = buffer.getvalue()

    def pillow() -> Image.Image:
        decoded = Image.open(io.BytesIO(data))
        decoded.load()
        return decoded

    ours = decode_png(data)
    if ours is None or not np.array_equal(np.asarray(ours), np.asarray(pillow())):
        raise AssertionError(f"{name}: our PNG decoding is not had, or differs from Pillow's")
    mine, theirs = median_s(lambda: decode_png(data), runs), median_s(pillow, runs)
    return (f"PNG {name:22} level {level}  {len(data) / 1e6:5.2f} MB: ours {mine * 1e3:5.1f} ms vs Pillow "
            f"{theirs * 1e3:5.1f} ms  ratio {mine / theirs:4.2f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args(argv)
    retain_freed_memory()
    print(f"P0's processing of one image (median of {args.runs}), mmserve (codes) vs transformers (float32 values);")
    print("the item's bytes; the worker's lookup of the values. The values are bit-equal (checked).")
    with tempfile.TemporaryDirectory() as folder:
        for name, (ours, hf) in processors(Path(folder)).items():
            for size in SIZES:
                print(row(name, size, ours, hf, args.runs), flush=True)
        print(request_rows(str(Path(folder) / "qwen2_5_vl"), args.runs))
    for size in (*SIZES, (4032, 3024)):
        print(resize_row(size, args.runs))
    for name, image in (("screenshot 1920x1080", screenshot((1920, 1080))), ("photo 1024x768", photo((1024, 768)))):
        for level in (1, 6):
            print(png_row(name, image, level, args.runs))


if __name__ == "__main__":
    main()
