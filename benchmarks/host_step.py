"""An engine step's host work: what a decode step costs the CPU besides the model's forward.

On a GPU the engine schedules, builds the step's inputs and handles its outputs while the GPU
waits (nothing of it overlaps the forward), so at large batches this host work is a share of every
decode step that no kernel speeds up (`make bench-gpu` prints the share the GPU was busy). With
--async-scheduling all of it runs while the GPU runs the step before (the next forward is queued
before the host reads the last tokens), so the GPU waits only where the host's step is the longer;
each batch's second line says how long that is, and the part run under the queued forward. Here
the forward is stubbed (zeros), so a step's time is host work alone: the scheduler, the runner's
inputs with the triton backend's metadata (the GPU path's), a tiny model's LM head and sampler,
and the update. Printed per batch at 2,048-token contexts: ms a step, us a request, and its parts.

Run: `python benchmarks/host_step.py` (about 30 s).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # the triton backend on a CPU (its kernels never run here)

import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from _gpu_decode import decoding, overlapped  # noqa: E402
from gpu_serving import build_checkpoint  # noqa: E402

PARTS = (("scheduler", "schedule"), ("executor", "execute_model"), ("scheduler", "update_from_output"))
# --async-scheduling: the next step's forward is queued before the host collects and samples
ASYNC_PARTS = (("scheduler", "schedule"), ("executor", "prepare"), ("executor", "launch"), ("executor", "collect"),
               ("executor", "sample"), ("scheduler", "update_from_output"))
UNDER_FORWARD = ("collect", "sample")
CONTEXT, STEPS = 2048, 60


def timed_parts(core: Any, parts: tuple[tuple[str, str], ...]) -> dict[str, float]:
    """Wraps the step's `parts` on `core` (instance attributes); returns their running seconds."""
    spent: dict[str, float] = {}  # in PARTS' order

    def timing(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        def wrapper(*args: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                spent[name] += time.perf_counter() - start
        return wrapper

    for owner_name, name in parts:
        owner = getattr(core, owner_name)
        spent[name] = 0.0
        setattr(owner, name, timing(getattr(owner, name), name))
    return spent


def host_steps(core: Any, batch: int) -> tuple[float, dict[str, float]]:
    """Median seconds of a decode step of `batch` requests with the forward stubbed, and each
    part's mean seconds a step (with the core's async scheduling on, `ASYNC_PARTS`)."""
    runner, hidden = core.executor.runner, core.executor.runner.model.config.text.hidden_size
    parts = ASYNC_PARTS if core.overlap else PARTS
    with decoding(core, batch, CONTEXT) as step:
        runner.model.forward = lambda embeds, *rest: embeds.new_zeros(embeds.shape[0], hidden)
        try:
            for _ in range(5):
                step()
            spent, took = timed_parts(core, parts), []
            for _ in range(STEPS):
                start = time.perf_counter()
                step()
                took.append(time.perf_counter() - start)
        finally:
            del runner.model.forward
            for owner_name, name in parts:
                delattr(getattr(core, owner_name), name)
    return statistics.median(took), {name: seconds / STEPS for name, seconds in spent.items()}


def main() -> None:
    from mmserve import LLM
    from mmserve.models.attention.backend import missing_package

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "model")
        build_checkpoint(path, tiny=True, device=torch.device("cpu"), dtype=torch.float32)
        backend = "torch" if missing_package("triton") else "triton"  # triton: the GPU path's metadata
        llm = LLM(model=path, device="cpu", max_model_len=CONTEXT + 512, enforce_eager=True,
                  attention_backend=backend, max_num_seqs=64)
        try:
            print(f"an engine step's host work (forward stubbed, {backend} backend's metadata, {CONTEXT}-token "
                  "contexts):")
            for batch in (1, 8, 64):
                step, parts = host_steps(llm.engine.core, batch)
                split = ", ".join(f"{name} {seconds * 1e3:.3f}" for name, seconds in parts.items())
                print(f"  batch {batch:3d}: {step * 1e3:6.3f} ms a step, {step / batch * 1e6:6.1f} us a request "
                      f"({split} ms)", flush=True)
                with overlapped(llm.engine.core):
                    step, parts = host_steps(llm.engine.core, batch)
                under = sum(parts[name] for name in UNDER_FORWARD)
                print(f"    --async-scheduling: {step * 1e3:.3f} ms a step, all of it while the device runs the "
                      f"step before; {under * 1e3:.3f} ms of it (collect, sample) under the forward it queued",
                      flush=True)
        finally:
            llm.shutdown()


if __name__ == "__main__":
    main()
