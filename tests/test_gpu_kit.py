"""The GPU kit's harness, checked on any machine (not `gpu`-marked: it runs in `make test`): the
references leave transformers as they found it, so every test after them in one process sees
the same library (on a GPU machine with torchvision, a leaked shim broke the CLIP processor)."""

from __future__ import annotations

import transformers.image_processing_backends as backends
import transformers.video_processing_utils as video_utils

from helpers.hf_video import hf_video_inputs, hf_video_processor
from helpers.tiny_models import make_qwen_checkpoint
from helpers.tiny_videos import make_frames

WATCHED = ((backends, "tvF"), (backends, "pil_torch_interpolation_mapping"), (video_utils, "tvF"))
ABSENT = object()


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
