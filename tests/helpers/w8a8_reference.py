"""W8A8's reference: transformers on the dequantized weights with its decoder projections'
inputs rounded to int8 per token as vLLM's `scaled_int8_quant` rounds them (written from vLLM's
kernel, not from mmserve's code), and the comparison of greedy runs where that rounding turns float
noise into whole quanta (`assert_greedy_close`)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

from helpers.quant_checkpoints import VISION, effective_input_scale

ROW_PARALLEL = ("o_proj", "down_proj")  # a rank holds a slice of their input


def int8_token_fake_quant(x: torch.Tensor, parts: int = 1) -> torch.Tensor:
    """x as W8A8's activations stand for it, as vLLM's `scaled_int8_quant` quantizes them (dynamic,
    per token): each row, or each of its `parts` slices (a row-parallel layer's ranks), rounded
    half to even at 127 / max|row| and clamped to int8, then scaled back by max|row| / 127."""
    slices = []
    for piece in x.float().chunk(parts, dim=-1):
        peak = piece.abs().amax(dim=-1, keepdim=True)
        top = torch.full_like(peak, 127.0)  # IEEE division, as CUDA's `/` in vLLM's kernel
        q = torch.where(peak > 0, torch.round(piece * (top / peak)), torch.zeros_like(piece)).clamp(-128, 127)
        slices.append(q * (peak / top))
    return torch.cat(slices, dim=-1).to(x.dtype)


def int8_static_fake_quant(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x as static W8A8's activations stand for it, as vLLM's `static_scaled_int8_quant` quantizes
    them: x / scale (IEEE, float32) rounded half to even, clamped to int8, times the scale."""
    s = torch.tensor(scale, dtype=torch.float32, device=x.device)
    return (torch.round(x.float() / s).clamp(-128, 127) * s).to(x.dtype)


def int8_activation_hooks(model: torch.nn.Module, tp: int = 1, static: str | None = None) -> None:
    """Make transformers' `model` quantize the inputs of its decoder projections (the layers
    `quantize_copy` quantizes) as W8A8 runs them: per token, and in `tp` slices for the
    row-parallel ones, as each rank of a tensor-parallel engine quantizes its own; with `static`
    (the format's name) by each layer's static scale (every rank's slice by the same)."""
    pattern = re.compile(r"layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)$")
    for name, module in model.named_modules():
        if not pattern.search(name) or any(v in name for v in VISION):
            continue
        if static is not None:
            scale = effective_input_scale(static, name)
            module.register_forward_pre_hook(lambda _m, args, scale=scale: (int8_static_fake_quant(args[0], scale),))
            continue
        parts = tp if name.endswith(ROW_PARALLEL) else 1
        module.register_forward_pre_hook(lambda _m, args, parts=parts: (int8_token_fake_quant(args[0], parts),))


def record_logprobs(into: list[torch.Tensor]) -> Callable[[torch.nn.Module], None]:
    """A `prepare` for the `hf_*_greedy` references: each step's log-probabilities over the
    vocabulary (the LM head's last row, float32) appended to `into`, prompt after prompt."""
    def prepare(model: torch.nn.Module) -> None:
        model.get_output_embeddings().register_forward_hook(
            lambda _m, _args, out: into.append(torch.log_softmax(out[0, -1].float(), dim=-1).cpu()))
    return prepare


def assert_greedy_close(ours: list[int], our_logprobs: list[dict[int, float]], theirs: list[int],
                        their_logprobs: list[torch.Tensor], tol: float) -> int:
    """W8A8's greedy tokens against the reference's, where rounding each token's activations to
    int8 turns float noise into whole quanta (a value at a rounding boundary, rounded the other
    way): at every step until the two part, the reference's token is among ours' top log-probabilities
    with its log-probability within `tol` of the reference's; where they part, the reference holds
    ours within `tol` of its own choice (a near tie), and the comparison ends. Returns the steps compared."""
    for step, (mine, ref) in enumerate(zip(ours, theirs)):
        lp = their_logprobs[step]
        assert ref in our_logprobs[step], f"step {step}: the reference's token {ref} not in our top log-probabilities"
        assert abs(our_logprobs[step][ref] - float(lp[ref])) < tol, f"step {step}: log-probabilities apart"
        if mine != ref:
            assert float(lp[ref] - lp[mine]) < tol, f"step {step}: {mine} != {ref}, not a near tie"
            return step + 1
    assert len(ours) == len(theirs)
    return len(ours)


def assert_w8a8_greedy_close(quantized: str, dequantized: str, items: list[dict], max_new: int,
                             reference: Callable[..., tuple[list[list[int]], list[int]]], tol: float,
                             static: str | None = None, **engine_args: Any) -> Any:
    """A W8A8 checkpoint's greedy tokens and log-probabilities (an `LLM` on `engine_args`, the CPU
    unless they name a device) against `reference` (`hf_greedy`, `hf_qwen_greedy`: transformers on
    `dequantized`, its activations quantized as the engine's ranks quantize them; `static`: a
    static format's name), by `assert_greedy_close`. Returns the `LLM`."""
    from mmserve import LLM, SamplingParams

    engine_args.setdefault("device", "cpu")
    llm = LLM(model=quantized, **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=max_new, logprobs=5)
    outs = [o.outputs[0] for o in llm.generate(items, params)]
    llm.engine.core.check_integrity()
    assert llm.engine.core.kv_cache.num_free_blocks == llm.engine.core.kv_cache.pool.num_blocks
    steps: list[torch.Tensor] = []
    record = record_logprobs(steps)

    def prepare(model: torch.nn.Module) -> None:
        int8_activation_hooks(model, engine_args.get("tensor_parallel_size", 1), static)
        record(model)

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[engine_args.get("dtype", "float32")]
    device = "cpu" if engine_args["device"] == "cpu" else "cuda"
    theirs = reference(dequantized, items, max_new, dtype=dtype, device=device, prepare=prepare)[0]
    for out, ref in zip(outs, theirs):
        mine = [{token: lp.logprob for token, lp in step.items()} for step in out.logprobs]
        assert_greedy_close(list(out.token_ids), mine, ref, steps[:len(ref)], tol)
        del steps[:len(ref)]
    return llm
