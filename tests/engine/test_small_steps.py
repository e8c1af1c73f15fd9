"""A CPU step of few tokens runs on one thread (waking OpenMP's second thread costs more than it
saves on a small matmul); a big step or one with encoder work uses every thread P1 was given."""

from __future__ import annotations

import torch

from mmserve import LLM, SamplingParams
from mmserve.worker.model_runner import SMALL_STEP_TOKENS
from helpers.tiny_models import make_checkpoint, make_image

PROMPT = "USER: <image>\nWhat is this? ASSISTANT:"


def test_small_steps_run_on_one_thread_and_big_ones_on_all(tmp_path):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        llm = LLM(model=make_checkpoint(tmp_path), max_model_len=256)
        runner = llm.engine.core.executor.runner
        seen: list[tuple[int, int]] = []  # (tokens in the step, threads during its forward)
        forward = runner.model.forward

        def recording(embeds, *args, **kwargs):
            seen.append((embeds.shape[0], torch.get_num_threads()))
            return forward(embeds, *args, **kwargs)

        runner.model.forward = recording
        prompt = {"prompt": PROMPT, "multi_modal_data": {"image": make_image(1)}}
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        assert seen[0][0] >= SMALL_STEP_TOKENS and seen[0][1] == 2  # the prefill, with the encoder
        assert seen[1:] and all(tokens == 1 and threads == 1 for tokens, threads in seen[1:])  # decode steps
        assert torch.get_num_threads() == 2  # the caller's setting is back after the last step
    finally:
        torch.set_num_threads(before)
