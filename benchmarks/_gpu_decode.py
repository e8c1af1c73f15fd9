"""Decode steps and per-kernel tables for the GPU benchmark (`gpu_serving.py`; the leading
underscore keeps `mmserve bench components` from running it).

A decode batch is set up on the offline `LLM`'s in-process engine core without paying for its
prefill: `batch` requests of `context` random tokens are scheduled with the model's forward
stubbed out (the KV cache keeps whatever it holds: a decode step reads the same bytes whatever
their values), then real decode steps run — through the CUDA graphs the runner captured, or
eagerly with them set aside (`eager`).
"""

from __future__ import annotations

import contextlib
import itertools
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from _gpu_limits import decode_step_bytes, sync
from mmserve.ipc.messages import EngineCoreRequest
from mmserve.sampling_params import SamplingParams

_ids = itertools.count()


@contextlib.contextmanager
def decoding(core: Any, batch: int, context: int) -> Iterator[Callable[[], None]]:
    """`batch` requests of `context` prompt tokens, prefilled with the forward stubbed out; yields
    a function that runs one engine step (checking it decoded one token per request); the
    requests are aborted after."""
    runner = core.executor.runner
    text = runner.model.config.text
    params = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
    g = torch.Generator().manual_seed(batch * 7919 + context)
    ids = [f"decode-{next(_ids)}" for _ in range(batch)]
    for rid in ids:
        prompt = torch.randint(0, text.vocab_size, (context,), generator=g).tolist()
        core.add_request(EngineCoreRequest(rid, prompt, [], params, None, time.time()))
    runner.model.forward = lambda embeds, *rest: embeds.new_zeros(embeds.shape[0], text.hidden_size)
    try:
        while not _decoding(core):
            core.step()
    finally:
        del runner.model.forward  # the class's forward again

    def step() -> None:
        decoded = sum(len(out.new_token_ids) for out in core.step().outputs)
        if decoded != batch:
            raise RuntimeError(f"a decode step gave {decoded} tokens for {batch} requests")

    try:
        yield step
    finally:
        core.abort_requests(ids)
        core.step()


def _decoding(core: Any) -> bool:
    """Every prompt computed, and with async scheduling a step in flight (a prompt the first-token
    cache answered has none yet), so that each later step gives one token per request."""
    prefilled = not core.scheduler.waiting and all(r.num_computed_tokens >= r.num_prompt_tokens
                                                   for r in core.scheduler.running)
    return prefilled and (core.step_in_flight or not core.overlap)


@contextlib.contextmanager
def overlapped(core: Any, on: bool = True) -> Iterator[None]:
    """The engine core's async scheduling (`--async-scheduling`) switched `on` inside the block."""
    was, core.overlap = core.overlap, on
    try:
        yield
    finally:
        core.overlap = was


@contextlib.contextmanager
def eager(runner: Any) -> Iterator[None]:
    """Decode steps run eagerly (the captured graphs set aside) inside the block."""
    graphs, runner.decode_graphs = runner.decode_graphs, None
    try:
        yield
    finally:
        runner.decode_graphs = graphs


def decode_step_time(core: Any, batch: int, context: int, steps: int, warmup: int = 3) -> float:
    """Median seconds of a decode step of `batch` requests at about `context` cached tokens."""
    return decode_step_times(core, batch, context, steps, warmup, busy=False)[0]


def decode_step_times(core: Any, batch: int, context: int, steps: int, warmup: int = 3,
                      busy: bool = True) -> tuple[float, float | None]:
    """`decode_step_time`'s median, and with `busy` the share of a few more steps that the device
    was busy (`device_busy`; None off CUDA or without `busy`). With the core's async scheduling
    on (`EngineCore.overlap`) a step overlaps the next one's host work, so the figure is the mean
    of `steps` steps run back to back (a sync between them would end the overlap)."""
    device = core.executor.runner.device
    with decoding(core, batch, context) as step:
        for _ in range(warmup):
            step()
        took = []
        if core.overlap:
            sync(device)
            start = time.perf_counter()
            for _ in range(steps):
                step()
            sync(device)
            took.append((time.perf_counter() - start) / steps)
        for _ in range(0 if core.overlap else steps):
            sync(device)
            start = time.perf_counter()
            step()  # ends with the step's one device-to-host copy
            took.append(time.perf_counter() - start)
        return statistics.median(took), device_busy(step, device) if busy else None


def device_busy(step: Callable[[], None], device: torch.device, steps: int = 4) -> float | None:
    """The share of `steps` calls of `step`'s wall time that the device spent in kernels and copies
    (torch.profiler with the CUDA activity alone, so the host runs unprofiled); the rest is host
    work (scheduling, inputs, outputs) that no kernel speeds up. None off CUDA, or where the
    profiler fails (said, and the benchmark goes on)."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            sync(device)
            start = time.perf_counter()
            for _ in range(steps):
                step()
            sync(device)
            wall = time.perf_counter() - start
        return sum(event.self_device_time_total for event in prof.key_averages()) * 1e-6 / wall
    except Exception as exc:  # a diagnostic: the timed figures stand without it
        print(f"  (device busy share not measured: {type(exc).__name__}: {exc})", flush=True)
        return None


def decode_read_bytes(core: Any, batch: int, context: int, steps: int, warmup: int = 3) -> int:
    """Bytes one step timed by `decode_step_time(core, batch, context, steps, warmup)` must read
    (`_gpu_limits.decode_step_bytes`), at the cached length of its middle timed step."""
    runner = core.executor.runner
    kv_per_token = runner.kv_cache_bytes_per_block() // runner.block_size
    return decode_step_bytes(runner.model, batch, context + warmup + steps // 2, kv_per_token)


def kernel_table(fn: Callable[[], Any], device: torch.device, rows: int = 15) -> str:
    """torch.profiler's table of `fn`'s ops by self device time (CPU time without a GPU), top `rows`."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        sync(device)
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=70)


def eager_decode_table(core: Any, batch: int, context: int) -> str:
    """The per-kernel table of one eager decode step of `batch` requests at `context` tokens."""
    runner = core.executor.runner
    with eager(runner), decoding(core, batch, context) as step:
        step()
        step()  # warm: allocator and kernels
        return kernel_table(step, runner.device)
