"""Device hygiene without a GPU: a whole engine run on the `meta` device.

On `meta` every tensor has a shape and no data. A tensor the runner, a model or the sampler makes
on a hard-coded (or default) CPU device and mixes with the device's tensors is an error there,
as it would be on CUDA; reading a device tensor's values on the host (`.tolist()`, `.item()`, a
branch on a tensor) fails too. The one allowed way back is `worker/device.py: to_host_async`'s copy,
which `HostCopies` counts (handing back zeros): exactly one per step that samples. (Meta has no
random generators: a seeded draw there is shape-only.)
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from mmserve import LLM, SamplingParams
from mmserve.worker.cuda_graphs import torch_decode_metadata
from helpers.tiny_models import make_checkpoint, make_image, make_qwen_checkpoint

LLAVA_PROMPT = "USER: <image>\nWhat is this? ASSISTANT:"
QWEN_PROMPT = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is this?<|im_end|>\n"
_READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.numpy, torch.Tensor.__bool__,
          torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__}


class HostCopies(TorchFunctionMode):
    """Counts copies of meta tensors to the host (each returns zeros) and any host read of one."""

    def __init__(self) -> None:
        super().__init__()
        self.copies = 0
        self.reads: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        tensor = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if tensor is not None and tensor.device.type == "meta":
            if func is torch.Tensor.cpu or (func is torch.Tensor.to and _to_host(args[1:], kwargs)):
                self.copies += 1
                return torch.zeros(tensor.shape, dtype=tensor.dtype)
            if func in _READS:
                self.reads.append(func.__name__)
            if func is torch.Tensor.exponential_:  # meta takes no generator: the draw is all it checks
                return tensor
        if func is torch.Tensor.copy_ and len(args) > 1 and isinstance(args[1], torch.Tensor):
            if args[1].device.type == "meta" and args[0].device.type == "cpu":
                self.copies += 1
                return args[0].zero_()
        return func(*args, **kwargs)


def _to_host(args: tuple, kwargs: dict) -> bool:
    targets = [*args, kwargs.get("device")]
    return any(str(t) == "cpu" for t in targets if isinstance(t, (str, torch.device)))


def _run_on_meta(model_dir: str, prompt: str, params: SamplingParams,
                 graphs: bool = False) -> tuple[Any, list[tuple[int, bool]], LLM]:
    """Generate on the meta device (with `graphs`, decode steps through the decode graphs' static
    buffers); (runner, [(host copies, sampled?) per step], the LLM: kept alive, since a collected
    LLM frees its runner)."""
    llm = LLM(model=model_dir, device="meta", max_model_len=256, num_kv_blocks=64)
    runner = llm.engine.core.executor.runner
    if graphs:
        runner.allocate_kv_cache(64, scratch=True)
        runner.enable_decode_graphs(torch_decode_metadata, capture=False)
    steps: list[tuple[int, bool]] = []
    execute = runner.execute_model
    copies = HostCopies()

    def counted(so: Any) -> Any:
        before = copies.copies
        out = execute(so)
        steps.append((copies.copies - before, any(out.sampled_token_ids.values())))
        return out

    runner.execute_model = counted
    with copies:
        llm.generate([{"prompt": prompt, "multi_modal_data": {"image": make_image(1)}}], params)
    assert copies.reads == [], f"device values read on the host: {copies.reads}"
    return runner, steps, llm


CASES = [pytest.param("llava", id="llava"), pytest.param("qwen2_5_vl", id="qwen2.5-vl"),
         pytest.param("qwen3_vl", id="qwen3-vl")]
EXTRAS = dict(presence_penalty=0.5, frequency_penalty=0.2, repetition_penalty=1.1, logit_bias={5: 1.0},
              min_tokens=2, logprobs=2, top_k=5, top_p=0.9)


@pytest.mark.parametrize("family", CASES)
def test_a_step_runs_on_the_device_alone_and_copies_back_once(tmp_path, family):
    model_dir = (make_checkpoint(tmp_path) if family == "llava"
                 else make_qwen_checkpoint(tmp_path, family=family))
    prompt = LLAVA_PROMPT if family == "llava" else QWEN_PROMPT
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=3, ignore_eos=True, **EXTRAS)
    runner, steps, _llm = _run_on_meta(model_dir, prompt, params)
    assert steps and all(sampled for _, sampled in steps)
    assert [n for n, _ in steps] == [1] * len(steps)  # one device-to-host transfer a step
    assert runner.num_encoded_items == 1
    held = [p for p in runner.model.parameters()] + [t for kv in runner.kv_caches for t in kv]
    held += list(runner.encoder_outputs.values())
    assert held and all(t.device.type == "meta" for t in held)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "decode-graphs"])
def test_a_greedy_batch_without_extras_copies_back_once(tmp_path, graphs):
    runner, steps, _llm = _run_on_meta(make_checkpoint(tmp_path), LLAVA_PROMPT,
                                 SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), graphs)
    assert [n for n, _ in steps] == [1] * len(steps) and len(steps) == 3
    assert not graphs or runner.decode_graphs.eager_runs == 2  # the two decode steps ran in the static buffers


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "decode-graphs"])
def test_async_scheduling_reads_nothing_on_the_host_and_copies_back_once_a_token(tmp_path, graphs):
    """--async-scheduling: a step's tokens in flight are read on the device by the next step's
    forward (no host read), and each sampled step still copies back once."""
    llm = LLM(model=make_checkpoint(tmp_path), device="meta", max_model_len=256, num_kv_blocks=64,
              async_scheduling=True)
    runner = llm.engine.core.executor.runner
    if graphs:
        runner.allocate_kv_cache(64, scratch=True)
        runner.enable_decode_graphs(torch_decode_metadata, capture=False)
    copies = HostCopies()
    with copies:
        out = llm.generate([{"prompt": LLAVA_PROMPT, "multi_modal_data": {"image": make_image(1)}}],
                           SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, **EXTRAS))
    assert copies.reads == [], f"device values read on the host: {copies.reads}"
    assert len(out[0].outputs[0].token_ids) == 4 and copies.copies == 4
    assert not graphs or runner.decode_graphs.eager_runs == 3  # the decode steps, their inputs filled there
