"""A CPU step of fewer tokens than the size measured for the model at start runs on one thread
(for the built-in model its decode steps: waking OpenMP's second thread costs more than it saves
on its small matmuls); a bigger step or one with encoder work uses every thread P1 was given."""

from __future__ import annotations

import torch

from mmserve import LLM, SamplingParams
from mmserve.worker.threads import ROWS, one_thread_below
from helpers.tiny_models import make_checkpoint, make_image

PROMPT = "USER: <image>\nWhat is this? ASSISTANT:"


def test_small_steps_run_on_one_thread_and_big_ones_on_all(tmp_path):
    """The rule, at a size set here: where the measurement puts it depends on the machine's load
    (`test_the_measurement_gives_a_size_measured_and_leaves_the_setting` checks what it gives)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        llm = LLM(model=make_checkpoint(tmp_path), max_model_len=256)
        runner = llm.engine.core.executor.runner
        runner.one_thread_below = 4
        seen: list[tuple[int, int]] = []  # (tokens in the step, threads during its forward)
        forward = runner.model.forward

        def recording(embeds, *args, **kwargs):
            seen.append((embeds.shape[0], torch.get_num_threads()))
            return forward(embeds, *args, **kwargs)

        runner.model.forward = recording
        greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": make_image(1)}}], greedy)
        assert seen[0][0] > 1 and seen[0][1] == 2  # the prefill, with the encoder
        assert seen[1:] and all(tokens == 1 and threads == 1 for tokens, threads in seen[1:])  # decode steps
        assert torch.get_num_threads() == 2  # the caller's setting is back after the last step
        seen.clear()
        llm.generate(["USER: Tell me a long story about the sea. ASSISTANT:"], greedy)
        assert seen[0][0] >= 4 and seen[0][1] == 2  # a text prefill of 4+ tokens, no encoder work: every thread
        assert all(threads == 1 for _, threads in seen[1:])
    finally:
        torch.set_num_threads(before)


def test_the_measurement_gives_a_size_measured_and_leaves_the_setting():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = torch.nn.Module()
        model.layers = torch.nn.ModuleList([torch.nn.Linear(512, 1024, bias=False)])  # a decoder layer's weight
        assert one_thread_below(model, 2, torch.device("cpu"), rounds=1) in (*ROWS, 2 * ROWS[-1])
        assert torch.get_num_threads() == 2
        assert one_thread_below(model, 1, torch.device("cpu")) == 0  # one thread: nothing to choose
        assert one_thread_below(model, 4, torch.device("meta")) == 0  # off the CPU: every thread
        assert one_thread_below(torch.nn.Module(), 2, torch.device("cpu")) == 2 * ROWS[-1]  # no decoder weight
    finally:
        torch.set_num_threads(before)
