"""Decode steps against the memory-bandwidth limit: each step's time beside the time its bytes take.

A random-weight Qwen3-VL (written by the built-in writer; default text model: hidden 1024, 12
layers, 8/4 heads of 128, MLP 3072, float32: the model of issue 42) runs on an in-process engine
core (scheduler, runner, sampler: the whole step). For each batch (1, 8, 32) and context (512,
4,096) the batch's prompts are prefilled with the model's forward stubbed out (the KV cache holds
random values written beforehand: the step reads real memory, and no minutes go to prefill), then
greedy decode steps are timed one by one.

Before each configuration the pool's free blocks are shuffled (a cache after hours of traffic:
no request's blocks lie side by side), so decode attention cannot lean on contiguous blocks.

Per configuration it prints the median step time (and its CPU time, every thread's), the bytes a
step must read (the text decoder's weights and LM head, and every request's cached K/V), and the
roofline bound of a step: the
larger of its bytes at the bandwidth a large copy achieves in the same run (read + write bytes
per second) and its floating-point work (2 per weight per token, 4 per cached key and query
head) at the rate a large matmul achieves in the same run, both measured before each
configuration. Then the ratio step / bound, which of the two bounds, and each phase's mean share
of a step: scheduling (`Scheduler.schedule`), inputs (the runner's step inputs and attention
metadata), model (the forward and LM head, attention excluded), attention (`attend` of every
layer, cache write included), sampling (the sampler), output (`Scheduler.update_from_output`),
other (the rest). Target: step / bound <= 1.5 at batch 8 and 32. `--compare-attention` measures
each configuration twice in turns: decode attention by our C kernel (`cpu_kernels.py`) and by
PyTorch's kernels over padded copies (the path without a C compiler), with the ratio of the two;
`--compare-eager` likewise against the step run layer by layer in Python (`--enforce-eager`): a
quantized model's decode steps otherwise run all decoder layers in one compiled C call
(models/cpu_decoder.py), whose time the phases count as model (attention included).

`--formats dense,awq,fp8-block,...` runs the grid once per weight format, in turn (quantized
copies of the model written in the published layouts: int4 in groups of 128, FP8 in 128 x 128
blocks or per row; `fp8-online` is `--quantization fp8`; `awq-int8` / `w4a16-int8` the int4 checkpoint
with `--cpu-activation-quant int8`, not exact); each format's bound counts the bytes
its weights hold, and the end prints each format's speed-up over dense float32 per configuration
(wall and CPU time) beside the ratio of the bytes the two steps read: the most a memory-bound
step could gain. `--kv-cache-dtype float16` runs every engine with that KV cache (the bound
counts the cache's bytes in its own dtype: half a float32 model's).

Run: `python benchmarks/decode_step.py [--quick] [--steps N] [--batches 1,8,32] [--contexts 512,4096]
[--text-config '{"hidden_size": 2048}'] [--model-dir DIR] [--formats dense,awq]
[--compare-attention] [--kv-cache-dtype float16]`. The full grid needs ~7 GiB for the KV
cache of 32 x 4,096 tokens; `--quick` is batches 1 and 8 at contexts 128 and 512.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import mmserve  # noqa: F401  (first: sets OMP_WAIT_POLICY before torch loads, as the engine's processes have it)
import torch

from mmserve.models.attention import cpu_kernels, torch_sdpa

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _gpu_limits import copy_bandwidth, matmul_rate  # noqa: E402
from quant_formats import FORMATS, activation_quant, format_checkpoint, summarize  # noqa: E402

TEXT = dict(hidden_size=1024, num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=4, head_dim=128,
            intermediate_size=3072, max_position_embeddings=8192)
PHASES = ("scheduling", "inputs", "model", "attention", "sampling", "output", "other")


class PhaseClock:
    """Exclusive time per phase: a timed call nested in another counts only for its own phase."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self._stack: list[list[float]] = []

    def timed(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self._stack.append([0.0])
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                took = time.perf_counter() - start
                self.totals[phase] += took - self._stack.pop()[0]
                if self._stack:
                    self._stack[-1][0] += took
        return wrapper


def write_model(text_config: dict[str, Any], model_dir: str) -> str:
    """The checkpoint directory (written into `model_dir` once: reused when there)."""
    from mmserve.models.builtin_qwen_vl import write_tiny_qwen_vl

    path = Path(model_dir)
    if not (path / "config.json").exists():
        write_tiny_qwen_vl(path, text_config=text_config)
    return str(path)



@contextlib.contextmanager
def model_checkpoint(text_config: dict[str, Any], model_dir: str | None) -> Iterator[str]:
    """`write_model`'s checkpoint in `model_dir` (kept), or in a temporary folder removed on exit
    together with the quantized copies `format_checkpoint` writes beside it (~0.7 GB a run)."""
    if model_dir:
        yield write_model(text_config, model_dir)
        return
    with tempfile.TemporaryDirectory(prefix="decode-step-") as parent:
        yield write_model(text_config, str(Path(parent) / "model"))

class Bench:
    """One engine core, its runner's KV cache filled with random values, and the phase clock."""

    def __init__(self, model_dir: str, max_batch: int, max_context: int, steps: int,
                 quantization: str | None = None, cpu_activation_quant: str = "none",
                 kv_cache_dtype: str = "auto") -> None:
        from mmserve.config import EngineConfig
        from mmserve.engine.core import EngineCore

        # the batch's first requests decode while the last ones prefill (4,096 tokens a step)
        longest = max_context + steps + max_batch * max_context // 4096 + 64
        self.max_model_len = longest
        blocks = max_batch * (-(-longest // 16) + 1) + 8
        config = EngineConfig.from_kwargs(model=model_dir, num_kv_blocks=blocks, max_num_seqs=max_batch,
                                          max_model_len=longest, enable_prefix_caching=False,
                                          quantization=quantization, cpu_activation_quant=cpu_activation_quant,
                                          kv_cache_dtype=kv_cache_dtype)
        self.core = EngineCore(config, model_dir)
        self.runner = self.core.executor.runner
        for k, v in self.runner.kv_caches:
            k.uniform_(-1, 1)
            v.uniform_(-1, 1)
        self.clock = PhaseClock()
        self._instrument()
        self._ids = 0
        self.cpu_took: list[float] = []  # CPU seconds of each timed step (`run`)

    def _instrument(self) -> None:
        import mmserve.worker.model_runner as mr

        core, runner, clock = self.core, self.runner, self.clock
        core.scheduler.schedule = clock.timed("scheduling", core.scheduler.schedule)
        core.scheduler.update_from_output = clock.timed("output", core.scheduler.update_from_output)
        for name in ("prepare_inputs", "to_device"):
            setattr(mr, name, clock.timed("inputs", getattr(mr, name)))
        runner.sample = clock.timed("sampling", runner.sample)
        runner.collect = clock.timed("sampling", runner.collect)
        runner.encoders.embed = clock.timed("model", runner.encoders.embed)
        runner.model.compute_logits = clock.timed("model", runner.model.compute_logits)
        forward = clock.timed("model", runner.model.forward)
        self.real_forward = forward
        wrapped: set[type] = set()

        def first_sees_meta(*args: Any, **kwargs: Any) -> Any:
            meta_type = type(args[3])
            if meta_type not in wrapped:  # every layer's attention, timed where the models call it
                wrapped.add(meta_type)
                meta_type.attend = clock.timed("attention", meta_type.attend)  # type: ignore[method-assign]
            return forward(*args, **kwargs)
        self.timed_forward = first_sees_meta

    def weight_bytes(self) -> int:
        """The text decoder's weights and the LM head (the embedding table is read a row a token),
        quantized ones as they are held."""
        return sum(p.numel() * p.element_size() for name, p in self.runner.model.named_parameters()
                   if "visual" not in name and "embed_tokens" not in name)

    def weight_count(self) -> int:
        """The decoder's and LM head's weights (multiply-adds per token), whatever their format."""
        from mmserve.models.parallel import ParallelLinear

        model = self.runner.model
        return model.lm_head.weight.numel() + sum(
            m.shape.out_features * m.shape.in_features for name, m in model.named_modules()
            if isinstance(m, ParallelLinear) and "visual" not in name)

    def scatter_free_blocks(self, seed: int) -> None:
        """Shuffle the pool's free queue: the next requests' blocks lie anywhere in the cache."""
        queue = self.core.scheduler.kv_cache.pool.free_queue
        blocks = [queue.popleft() for _ in range(len(queue))]
        for i in torch.randperm(len(blocks), generator=torch.Generator().manual_seed(seed)).tolist():
            queue.append(blocks[i])

    def attention_flops_per_key(self) -> int:
        """Multiply-adds of one query token over one cached key, every layer (scores and values)."""
        text = self.runner.model.config.text
        return 4 * text.num_attention_heads * text.head_dim * text.num_hidden_layers

    def kv_bytes_per_token(self) -> int:
        """Cached K/V bytes of one token, every layer, in the cache's own dtype (`--kv-cache-dtype`)."""
        k, _ = self.runner.kv_caches[0]
        return 2 * len(self.runner.kv_caches) * k[0, 0].numel() * k.element_size()

    def run(self, batch: int, context: int, steps: int, warmup: int = 2) -> tuple[list[float], dict[str, float]]:
        """Seconds of each timed decode step, and each phase's seconds over them."""
        from mmserve.ipc.messages import EngineCoreRequest
        from mmserve.sampling_params import SamplingParams

        self.scatter_free_blocks(batch * 7 + context)
        params = SamplingParams(temperature=0.0, max_tokens=self.max_model_len - context - 1, ignore_eos=True)
        g = torch.Generator().manual_seed(batch * 100003 + context)
        vocab = self.runner.model.config.text.vocab_size
        ids = []
        for _ in range(batch):
            self._ids += 1
            ids.append(f"r{self._ids}")
            prompt = torch.randint(0, vocab, (context,), generator=g).tolist()
            self.core.add_request(EngineCoreRequest(ids[-1], prompt, [], params, None, time.time()))
        hidden = self.runner.model.config.text.hidden_size
        self.runner.model.forward = lambda embeds, *rest: embeds.new_zeros(embeds.shape[0], hidden)
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in self.core.scheduler.running) \
                or self.core.scheduler.waiting:
            self.core.step()  # prefill: no forward, the cache keeps its random values
        self.runner.model.forward = self.timed_forward
        for _ in range(warmup):
            self.core.step()
        self.clock.totals.clear()
        took, self.cpu_took = [], []
        for _ in range(steps):
            t, cpu = time.perf_counter(), time.process_time()
            outputs = self.core.step().outputs
            took.append(time.perf_counter() - t)
            self.cpu_took.append(time.process_time() - cpu)
            if sum(len(o.new_token_ids) for o in outputs) != batch:
                raise RuntimeError(f"a step decoded {len(outputs)} requests of {batch}")
        self.core.abort_requests(ids)
        self.core.step()
        phases = dict(self.clock.totals)
        phases["other"] = sum(took) - sum(phases.values())
        return took, phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--contexts", default="512,4096")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--quick", action="store_true", help="batches 1 and 8 at contexts 128 and 512, 6 steps")
    parser.add_argument("--text-config", default="{}", help="JSON overriding the text model's config")
    parser.add_argument("--model-dir", help="write the checkpoint here (reused when it exists)")
    parser.add_argument("--formats", default="dense", help=f"weight formats, in turn: {', '.join(FORMATS)}")
    parser.add_argument("--kv-cache-dtype", default="auto", help="the engine's --kv-cache-dtype (auto: the model's)")
    parser.add_argument("--compare-attention", action="store_true",
                        help="also measure decode attention over padded copies (no C kernel), in turns")
    parser.add_argument("--compare-eager", action="store_true",
                        help="also measure each step layer by layer in Python (--enforce-eager), in turns")
    args = parser.parse_args()
    if args.quick:
        args.batches, args.contexts, args.steps = "1,8", "128,512", 6
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    with model_checkpoint({**TEXT, **json.loads(args.text_config)}, args.model_dir) as model_dir:
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; C decode kernel: "
              f"{'built' if cpu_kernels.load() is not None else 'unavailable'}; KV cache: {args.kv_cache_dtype}")
        paths = measured_paths(args)
        print(f"{'format':>11} {'path':>6} {'batch':>5} {'ctx':>5} {'step ms':>8} {'cpu ms':>7} {'MB read':>8} "
              f"{'GB/s':>5} {'GFLOP/s':>7} {'bound ms':>8} {'of':>4} {'ratio':>6} {'tok/s':>7}  "
              + " ".join(f"{p:>10}" for p in PHASES) + "  (phase ms per step)")
        worst: dict[str, float] = {}
        steps: dict[tuple[str, str, int, int], list[float]] = defaultdict(list)  # a format named twice: both runs
        cpu: dict[tuple[str, str, int, int], list[float]] = defaultdict(list)
        read: dict[tuple[str, int, int], int] = {}
        for fmt in args.formats.split(","):
            path, quantization = format_checkpoint(model_dir, fmt)
            bench = Bench(path, max(batches), max(contexts), args.steps, quantization, activation_quant(fmt),
                          args.kv_cache_dtype)
            for batch in batches:
                for context in contexts:
                    for attention in paths:
                        step, ratio, read[fmt, batch, context], cpu_step = measure(
                            bench, fmt, attention, batch, context, args.steps)
                        steps[fmt, attention, batch, context].append(step)
                        cpu[fmt, attention, batch, context].append(cpu_step)
                        if batch >= 8:
                            worst[attention] = max(worst.get(attention, 0.0), ratio)
                    for other in paths[1:]:
                        ratio = steps[fmt, "kernel", batch, context][-1] / steps[fmt, other, batch, context][-1]
                        print(f"{'':>18} {batch:5d} {context:5d} kernel / {other} step time: {ratio:.2f}")
            del bench
        for path, ratio in worst.items():
            print(f"worst step / bound ratio at batch >= 8 ({path}): {ratio:.2f} (target <= 1.5)")
        summarize(steps, cpu, read)


def measured_paths(args: argparse.Namespace) -> tuple[str, ...]:
    """The ways each configuration runs, in turns (`attention_path`): as the engine does, then the
    comparisons asked for."""
    return ("kernel", *(("padded",) if args.compare_attention else ()), *(("eager",) if args.compare_eager else ()))


def measure(bench: Bench, fmt: str, path: str, batch: int, context: int,
            steps: int) -> tuple[float, float, int, float]:
    """One configuration's row: (median step seconds, step / bound, bytes a step reads, median CPU
    seconds of a step: every thread's)."""
    weights, per_token = bench.weight_bytes(), bench.kv_bytes_per_token()
    cpu = torch.device("cpu")
    bandwidth, rate = copy_bandwidth(cpu, 512 << 20), matmul_rate(cpu, torch.float32, 2048)
    with attention_path(path, bench):
        took, phases = bench.run(batch, context, steps)
    step, cpu = statistics.median(took), statistics.median(bench.cpu_took)
    keys = batch * (context + 2 + steps // 2)
    read = weights + per_token * keys
    flops = 2 * bench.weight_count() * batch + bench.attention_flops_per_key() * keys
    bound, of = max((read / bandwidth, "mem"), (flops / rate, "flop"))
    print(f"{fmt:>11} {path:>6} {batch:5d} {context:5d} {step * 1e3:8.1f} {cpu * 1e3:7.1f} {read / 1e6:8.0f} "
          f"{bandwidth / 1e9:5.1f} {rate / 1e9:7.0f} {bound * 1e3:8.1f} {of:>4} {step / bound:6.2f} "
          f"{batch / step:7.1f}  "
          + " ".join(f"{phases.get(p, 0.0) * 1e3 / len(took):10.2f}" for p in PHASES), flush=True)
    return step, step / bound, read, cpu


@contextlib.contextmanager
def attention_path(path: str, bench: Bench) -> Iterator[None]:
    """Decode steps as the engine runs them ("kernel": attention by the C kernel, the layers in one
    compiled call where models/cpu_decoder.py covers the model), with attention over padded copies
    ("padded"), or layer by layer in Python ("eager", as --enforce-eager) meanwhile."""
    if path == "kernel":
        yield
        return
    if path == "eager":
        text_model = bench.runner.model.text_model
        plan, text_model.cpu_decoder = text_model.cpu_decoder, None
        try:
            yield
        finally:
            text_model.cpu_decoder = plan
        return
    real = torch_sdpa.kernel_splits
    torch_sdpa.kernel_splits = lambda requests, blocks: 0  # type: ignore[assignment]
    try:
        yield
    finally:
        torch_sdpa.kernel_splits = real


if __name__ == "__main__":
    main()
