"""vLLM's `serve` flags that mmserve has no flag of its own for, so that a vLLM command line runs.

A vLLM user's command line carries flags like `--trust-remote-code`, `--disable-log-requests` or
`--enable-chunked-prefill`. Each such flag is here, in one of three kinds:
- **done**: what mmserve does anyway (chunked prefill is always on; no checkpoint code is run);
  accepted, with one start-up line saying so;
- **ignored**: a knob of vLLM's own machinery with no counterpart here (`--swap-space`:
  preemption recomputes); accepted, with one start-up line saying what mmserve does instead;
- **refused**: a feature mmserve does not have (LoRA, speculative decoding, tracing); the start stops
  with one line naming it, as for any bad flag — a server that silently lacks what was asked for
  would answer differently from what its operator expects.
A flag that takes values may be done for some (`--load-format safetensors`) and refused for the
others (`--load-format gguf`). `add_vllm_flags` adds them to `mmserve serve`'s parser (hidden from
`--help`); `vllm_flag_notes` reads a parsed namespace: the start-up lines, or a ValueError.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

DONE, IGNORED, REFUSED = "done", "ignored", "refused"


@dataclass(frozen=True)
class VllmFlag:
    """vLLM's `flag`: `kind` with `why`; a flag with `accepts` is `kind` for those values only and
    refused for the others; `switch`: it takes no value, and its `--no-` form asks for what mmserve
    does anyway (said nothing of), unless `no_refused`: it asks mmserve not to do what it always does."""

    flag: str
    kind: str
    why: str
    switch: bool = False
    accepts: tuple[str, ...] = ()
    no_refused: bool = False

    @property
    def dest(self) -> str:
        return "vllm_" + self.flag[2:].replace("-", "_")


VLLM_FLAGS = (
    VllmFlag("--trust-remote-code", DONE, "mmserve runs no code from a checkpoint: its model families are built in",
             switch=True),
    VllmFlag("--enable-chunked-prefill", DONE, "chunked prefill is always on (--max-num-batched-tokens sizes it)",
             switch=True, no_refused=True),
    VllmFlag("--disable-log-requests", DONE, "mmserve logs no request contents (the access log has one line each)",
             switch=True),
    VllmFlag("--enable-log-requests", IGNORED, "mmserve logs no request contents (the access log has one line each)",
             switch=True),
    VllmFlag("--enable-prompt-tokens-details", DONE, "usage always has prompt_tokens_details.cached_tokens",
             switch=True),
    VllmFlag("--disable-frontend-multiprocessing", IGNORED, "the engine core always runs in its own process",
             switch=True),
    VllmFlag("--disable-custom-all-reduce", IGNORED, "tensor parallelism reduces through torch.distributed",
             switch=True),
    VllmFlag("--swap-space", IGNORED, "a preempted request is recomputed; no KV blocks are swapped to the CPU"),
    VllmFlag("--max-seq-len-to-capture", IGNORED, "CUDA graphs hold decode steps of any length "
             "(--enforce-eager turns them off)"),
    VllmFlag("--compilation-config", IGNORED, "mmserve's CUDA graphs are its own (--enforce-eager turns them off)"),
    VllmFlag("--max-logprobs", IGNORED, "logprobs, top_logprobs and prompt_logprobs take at most 20 (OpenAI's limit)"),
    VllmFlag("--uvicorn-log-level", IGNORED, "--log-level sets the server's log level"),
    VllmFlag("--max-num-partial-prefills", IGNORED, "prefill chunks are scheduled within --max-num-batched-tokens"),
    VllmFlag("--max-long-partial-prefills", IGNORED, "prefill chunks are scheduled within --max-num-batched-tokens"),
    VllmFlag("--long-prefill-token-threshold", IGNORED, "prefill chunks are scheduled within "
             "--max-num-batched-tokens"),
    VllmFlag("--max-log-len", DONE, "mmserve logs no request contents (the access log has one line each)"),
    VllmFlag("--enable-log-outputs", IGNORED, "mmserve logs no request contents (the access log has one line each)",
             switch=True),
    VllmFlag("--code-revision", DONE, "mmserve runs no code from a checkpoint: its model families are built in"),
    VllmFlag("--disable-sliding-window", DONE, "no model family mmserve serves uses sliding-window attention",
             switch=True),
    VllmFlag("--disable-cascade-attn", DONE, "mmserve has no cascade attention", switch=True),
    VllmFlag("--max-cudagraph-capture-size", IGNORED, "--cuda-graph-sizes names the decode batch sizes captured"),
    VllmFlag("--response-role", DONE, "a chat answer's role is assistant", accepts=("assistant",)),
    VllmFlag("--mm-encoder-tp-mode", IGNORED, "under tensor parallelism the vision tower's weights are split, as "
             "the decoder's (vLLM's weights mode)", accepts=("weights", "data")),
    VllmFlag("--tokenizer-mode", DONE, "the checkpoint's fast tokenizer is used", accepts=("auto", "hf")),
    VllmFlag("--load-format", DONE, "weights are read from safetensors", accepts=("auto", "safetensors")),
    VllmFlag("--task", DONE, "text generation is the default; embeddings: --runner pooling",
             accepts=("auto", "generate")),
    VllmFlag("--model-impl", DONE, "mmserve's own model code runs", accepts=("auto", "vllm")),
    VllmFlag("--guided-decoding-backend", DONE, "structured outputs are xgrammar's", accepts=("auto", "xgrammar")),
    VllmFlag("--distributed-executor-backend", DONE, "tensor-parallel workers are local processes (Ray runs "
             "data-parallel ranks: --data-parallel-backend ray)", accepts=("mp",)),
    VllmFlag("--pipeline-parallel-size", DONE, "one pipeline stage (tensor and data parallelism split the work)",
             accepts=("1",)),
    VllmFlag("--enable-lora", REFUSED, "LoRA adapters are not supported", switch=True),
    VllmFlag("--lora-modules", REFUSED, "LoRA adapters are not supported"),
    VllmFlag("--speculative-config", REFUSED, "speculative decoding is not supported"),
    VllmFlag("--kv-transfer-config", REFUSED, "disaggregated prefill (KV transfer) is not supported"),
    VllmFlag("--enable-sleep-mode", REFUSED, "sleep mode is not supported", switch=True),
    VllmFlag("--otlp-traces-endpoint", REFUSED, "OpenTelemetry tracing is not supported"),
    VllmFlag("--cpu-offload-gb", REFUSED, "weights are not offloaded to the CPU"),
    VllmFlag("--tokenizer", REFUSED, "the tokenizer is the checkpoint's own (--tokenizer-revision takes it from "
             "another revision)"),
    VllmFlag("--skip-tokenizer-init", REFUSED, "the tokenizer is always loaded", switch=True),
    VllmFlag("--logits-processors", REFUSED, "logits processors of your own are not supported"),
    VllmFlag("--tool-parser-plugin", REFUSED, "tool parsers are built in (--tool-call-parser)"),
)


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """Add each of `VLLM_FLAGS` (not shown in --help); unset, each reads None."""
    for f in VLLM_FLAGS:
        if f.switch:
            parser.add_argument(f.flag, dest=f.dest, default=None, action=argparse.BooleanOptionalAction,
                                help=argparse.SUPPRESS)
        else:
            parser.add_argument(f.flag, dest=f.dest, default=None, help=argparse.SUPPRESS)


def vllm_flag_notes(ns: argparse.Namespace) -> list[str]:
    """One start-up line per vLLM flag given that mmserve accepts; a ValueError naming the first
    it refuses."""
    notes = []
    for f in VLLM_FLAGS:
        value = getattr(ns, f.dest, None)
        if value is None:
            continue
        if f.switch and value is False:
            if f.no_refused:  # asks mmserve not to do what it always does
                raise ValueError(f"--no-{f.flag[2:]} (vLLM's flag) cannot be honoured: {f.why}")
            continue
        if f.kind == REFUSED:
            raise ValueError(f"{f.flag} (vLLM's flag): {f.why}")
        if f.accepts and str(value).lower() not in f.accepts:
            raise ValueError(f"{f.flag} (vLLM's flag) takes {' or '.join(f.accepts)} here ({f.why}); got {value!r}")
        shown = f.flag if f.switch else f"{f.flag} {value}"
        notes.append(f"vLLM's {shown}: {'done anyway' if f.kind == DONE else 'no effect'} — {f.why}")
    return notes
