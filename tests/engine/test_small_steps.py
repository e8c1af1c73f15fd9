"""A CPU step of few tokens runs on the threads measured for the model at start (one for the
built-in model: waking OpenMP's second thread costs more than it saves on its small matmuls); a
big step or one with encoder work uses every thread P1 was given."""

from __future__ import annotations

import torch

from mmserve import LLM, SamplingParams
from mmserve.worker.model_runner import SMALL_STEP_TOKENS
from mmserve.worker.threads import small_step_threads
from tiny_models import make_checkpoint, make_image

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
        assert runner.small_step_threads == 1  # measured: the built-in model's matmuls are small
        assert seen[1:] and all(tokens == 1 and threads == 1 for tokens, threads in seen[1:])  # decode steps
        assert torch.get_num_threads() == 2  # the caller's setting is back after the last step
    finally:
        torch.set_num_threads(before)


def test_the_measurement_picks_one_thread_or_all_and_leaves_the_setting():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = torch.nn.Module()
        model.layers = torch.nn.ModuleList([torch.nn.Linear(512, 1024, bias=False)])  # a decoder layer's weight
        assert small_step_threads(model, 2, torch.device("cpu"), rounds=2) in (1, 2)
        assert torch.get_num_threads() == 2
        assert small_step_threads(model, 1, torch.device("cpu")) == 1
        assert small_step_threads(model, 4, torch.device("meta")) == 4  # off the CPU: every thread
        assert small_step_threads(torch.nn.Module(), 2, torch.device("cpu")) == 1  # no decoder weight
    finally:
        torch.set_num_threads(before)
