"""transformers' Qwen video processors as test references, on machines with torchvision and without.

Without torchvision (this CPU machine: it cannot be installed beside this torch) transformers'
video processors lack the two torchvision kernels they call; `torchvision_shim` gives them as
torchvision's source defines them, scoped to each call of the processor, never left in
transformers' modules."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import types
from collections.abc import Iterator

import torch


class _InterpolationMode(str):
    """Stands in for torchvision's InterpolationMode (an Enum of str values)."""

    @property
    def value(self) -> str:
        return str(self)


def _tv_resize(image, size, interpolation=None, antialias=True, **_):
    """torchvision.transforms.v2.functional.resize_image for a CPU tensor, bicubic or bilinear, as
    its source has it: uint8 stays uint8 (native kernel), an unchanged size returns the input."""
    if tuple(image.shape[-2:]) == tuple(size):
        return image
    shape = image.shape
    flat = image.reshape(-1, *shape[-3:])
    out = torch.nn.functional.interpolate(flat, size=list(size), mode=interpolation.value, align_corners=False,
                                          antialias=antialias)
    return out.reshape(*shape[:-2], *size)


def _tv_normalize(tensor, mean, std, inplace=False):
    """torchvision's normalize: (x - mean) / std per channel."""
    tensor = tensor if inplace else tensor.clone()
    mean = torch.as_tensor(mean, dtype=tensor.dtype).view(-1, 1, 1)
    std = torch.as_tensor(std, dtype=tensor.dtype).view(-1, 1, 1)
    return tensor.sub_(mean).div_(std)


_SHIM = types.SimpleNamespace(resize=_tv_resize, normalize=_tv_normalize, grayscale_to_rgb=lambda v: v,
                              InterpolationMode=types.SimpleNamespace(BICUBIC=_InterpolationMode("bicubic"),
                                                                      LANCZOS=_InterpolationMode("lanczos")))


def hf_video_processor(path: str, family: str):
    """transformers' own `Qwen3VLVideoProcessor` / `Qwen2VLVideoProcessor` for a checkpoint.

    Where torchvision is installed (every GPU machine) this is the class as transformers ships it.
    Elsewhere torchvision cannot be installed beside this torch: its `resize` and `normalize` (the
    only torchvision calls on this path) are given as its source defines them, and stand in for it
    only while the processor is built or called (`torchvision_shim`: transformers' modules are
    restored after each call, so the rest of the process, e.g. the CLIP image processor, never
    sees them); everything else — sampling, sizing, the fused rescale, padding, patchify, the
    grid — is transformers' code."""
    from transformers.utils import is_torchvision_available

    folder = "qwen3_vl" if family == "qwen3_vl" else "qwen2_vl"
    name = "Qwen3VLVideoProcessor" if family == "qwen3_vl" else "Qwen2VLVideoProcessor"
    if is_torchvision_available():
        cls = getattr(importlib.import_module(f"transformers.models.{folder}.video_processing_{folder}"), name)
        return cls.from_pretrained(path, cap_pixels_per_frame=False)
    with torchvision_shim():
        return _shimmed(getattr(_module_without_torchvision(folder), name)).from_pretrained(
            path, cap_pixels_per_frame=False)


_ABSENT = object()


@contextlib.contextmanager
def torchvision_shim() -> Iterator[types.SimpleNamespace]:
    """torchvision's functional `tvF` (the shim) in transformers' image and video backends for the
    duration of the block; each attribute is put back as it was (or removed) after it."""
    import transformers.image_processing_backends as backends
    import transformers.video_processing_utils as video_utils
    from transformers.image_utils import PILImageResampling

    shim = _SHIM
    interpolation = {PILImageResampling.BICUBIC: shim.InterpolationMode.BICUBIC}
    patches = [(backends, "tvF", shim), (video_utils, "tvF", shim),
               (backends, "pil_torch_interpolation_mapping", interpolation)]
    saved = [(module, attr, module.__dict__.get(attr, _ABSENT)) for module, attr, _ in patches]
    for module, attr, value in patches:
        setattr(module, attr, value)
    try:
        yield shim
    finally:
        for module, attr, before in saved:
            if before is _ABSENT:
                delattr(module, attr)
            else:
                setattr(module, attr, before)


def _shimmed(cls: type) -> type:
    """A subclass of the video processor `cls` that calls itself inside `torchvision_shim`."""

    def __call__(self, *args, **kwargs):
        with torchvision_shim():
            return cls.__call__(self, *args, **kwargs)

    return type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__})


def _module_without_torchvision(folder: str) -> types.ModuleType:
    """A private copy of transformers' `video_processing_<folder>` module whose `tvF` is the shim
    (the module may import torchvision at its top: its source is loaded without that line)."""
    spec = importlib.util.find_spec(f"transformers.models.{folder}.video_processing_{folder}")
    source = spec.loader.get_source(spec.name).replace("import torchvision.transforms.v2.functional as tvF",
                                                       "tvF = None")
    module = types.ModuleType(spec.name)
    module.__package__, module.__file__ = f"transformers.models.{folder}", spec.origin
    saved = sys.modules.get(spec.name)
    sys.modules[spec.name] = module  # inspect (transformers' docstring decorator) looks the class up there
    try:
        exec(compile(source, spec.origin, "exec"), module.__dict__)
    finally:
        if saved is None:
            del sys.modules[spec.name]
        else:
            sys.modules[spec.name] = saved
    module.tvF = _SHIM
    return module


def hf_video_inputs(processor, frames, source_fps: float, **kwargs) -> dict:
    """transformers' processing of one video given as decoded frames [T, H, W, 3] uint8 and its
    fps: `pixel_values_videos`, `video_grid_thw`, and the sampling metadata."""
    from transformers.video_utils import VideoMetadata

    meta = VideoMetadata(total_num_frames=len(frames), fps=source_fps, width=frames.shape[2],
                         height=frames.shape[1])
    kwargs.setdefault("do_sample_frames", True)
    return processor(videos=[frames], video_metadata=[meta], return_tensors="pt", return_metadata=True, **kwargs)
