"""The scheduler's config, and the encoder budget it derives."""

from __future__ import annotations

from dataclasses import dataclass

from mmserve.config.fields import opt


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = opt(64, "Most requests running in one step.")
    max_num_batched_tokens: int = opt(4096, "Token budget of one step (prefill chunks + decodes).")
    max_num_encoder_input_tokens: int | None = opt(
        None, "Vision encoder budget of one step in embedding tokens (default: --max-num-batched-tokens; "
        "never below one image's).")
    encoder_cache_tokens: int | None = opt(
        None, "Encoder outputs kept for reuse across requests, in embedding tokens (default: "
        "--max-num-batched-tokens; never below one image's); 0 keeps an output only while running "
        "requests use it (no reuse by later requests).")
    disable_chunked_mm_input: bool = opt(
        False, "Never split an image's placeholder tokens across steps (--max-num-batched-tokens must hold one image).")
    scheduling_policy: str = opt(
        "fcfs", "fcfs: requests are admitted in arrival order within each user's fair share; priority: by "
        "each request's `priority` first (the lower, the sooner; vLLM's), and when KV blocks run out the "
        "least urgent running request is preempted.", choices=("fcfs", "priority"))
    max_grammar_compile_s: float = opt(
        10.0, "Longest a structured-output grammar may take to compile (off the engine step); a request "
        "whose grammar takes longer is refused.")
    async_scheduling: bool = opt(
        False, "Overlap the host's work with the device's: the next step is "
        "scheduled and its inputs built while the device runs this one, each running request assumed "
        "to go on by one token (a request that stopped has its extra token discarded); the same tokens "
        "as without it, an output one step later.")
    stalled_stream_abort_s: float = opt(
        60.0, "A request whose caller has read none of its outputs for this long while new ones arrive (a "
        "stream nobody reads) is aborted with one log line; until then its unread outputs are merged into one.")

    def __post_init__(self) -> None:
        if not self.stalled_stream_abort_s > 0:
            raise ValueError(f"stalled_stream_abort_s must be positive; got {self.stalled_stream_abort_s}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1; got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1; got {self.max_num_batched_tokens}")
        if self.max_num_encoder_input_tokens is not None and self.max_num_encoder_input_tokens < 1:
            raise ValueError("max_num_encoder_input_tokens must be at least 1; "
                             f"got {self.max_num_encoder_input_tokens}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority'; got {self.scheduling_policy!r}")
        if not self.max_grammar_compile_s > 0:
            raise ValueError(f"max_grammar_compile_s must be positive; got {self.max_grammar_compile_s}")
        if self.encoder_cache_tokens is not None and self.encoder_cache_tokens < 0:
            raise ValueError(f"encoder_cache_tokens must not be negative; got {self.encoder_cache_tokens}")


def compute_encoder_budget(config: SchedulerConfig, max_item_tokens: int) -> tuple[int, int]:
    """(encoder compute budget per step, encoder cache size), both in embedding tokens.

    Each is its flag (`--max-num-encoder-input-tokens`, `--encoder-cache-tokens`; unset or 0:
    `--max-num-batched-tokens`), raised to the largest item's `max_item_tokens` so that every
    item can run. With `--disable-chunked-mm-input` an item's placeholders must fit one step's
    token budget: a ValueError naming the flag to raise when the largest does not.
    """
    if config.disable_chunked_mm_input and max_item_tokens > config.max_num_batched_tokens:
        raise ValueError(f"with --disable-chunked-mm-input an image's {max_item_tokens} placeholder tokens must fit "
                         f"one step, but --max-num-batched-tokens is {config.max_num_batched_tokens}; raise "
                         f"--max-num-batched-tokens to at least {max_item_tokens}")
    compute = max(config.max_num_encoder_input_tokens or config.max_num_batched_tokens, max_item_tokens)
    cache_size = max(config.encoder_cache_tokens or config.max_num_batched_tokens, max_item_tokens)
    return compute, cache_size
