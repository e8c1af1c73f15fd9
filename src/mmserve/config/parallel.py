"""Where the engine runs: its ranks (`ParallelConfig`) and its device (`DeviceConfig`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mmserve.config.fields import comma_list, opt

_DEVICES = ("auto", "cuda", "cpu")
_DP_BACKENDS = ("mp", "ray")
_DP_ROUTINGS = ("cache_aware", "load")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = opt(
        1, "Worker processes the model is sharded over (Megatron-style); 1 runs it inside the engine core.")
    data_parallel_size: int = opt(
        1, "Engine-core processes (ranks), each with its own scheduler, KV, prefix and encoder caches "
        "and its own tensor-parallel workers; requests are routed between them.")
    data_parallel_backend: str = opt(
        "mp", "How ranks are started: mp (local processes) or ray (actors in a placement group per rank; "
        "pip install mmserve[ray]).", choices=_DP_BACKENDS)
    ray_address: str | None = opt(None, "Ray cluster to join with --data-parallel-backend ray "
                                  "(default: RAY_ADDRESS, else a local cluster is started).")
    dp_routing: str = opt(
        "cache_aware", "How a request picks its rank: cache_aware (where its prefix blocks and images are "
        "cached, weighed against load) or load (least loaded).", choices=_DP_ROUTINGS)
    dp_imbalance_slack: int = opt(
        4, "Routing guard: a rank chosen for its cache may carry at most this many in-flight requests "
        "(plus half the least-loaded rank's) more than the least-loaded rank.")
    engine_restart_limit: int = opt(
        3, "Restarts per rank after its engine core dies (requests that showed the client nothing "
        "move to a live rank meanwhile); 0: a dead engine stops the server.")
    api_server_count: int = opt(
        1, "API-server processes sharing the listening socket; every one reaches every engine core, and the "
        "processor and IPC caches' budgets are split between them (one budget in all, not one each).")
    data_parallel_rank: int = opt(0, "This engine core's rank (set per process, not a flag).", cli=False)
    api_server_index: int = opt(0, "This API server's index (set per process, not a flag).", cli=False)
    engine_restarts: int = opt(0, "How often this rank's engine core was restarted (set per process, not a flag).",
                               cli=False)

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1; got {self.tensor_parallel_size}")
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be at least 1; got {self.data_parallel_size}")
        if self.data_parallel_backend not in _DP_BACKENDS:
            raise ValueError(f"data_parallel_backend must be mp or ray; got {self.data_parallel_backend!r}")
        if self.dp_routing not in _DP_ROUTINGS:
            raise ValueError(f"dp_routing must be cache_aware or load; got {self.dp_routing!r}")
        if self.dp_imbalance_slack < 0 or self.engine_restart_limit < 0:
            raise ValueError("dp_imbalance_slack and engine_restart_limit must not be negative")
        if not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(f"data_parallel_rank must be in [0, {self.data_parallel_size}); "
                             f"got {self.data_parallel_rank}")
        if self.api_server_count < 1:
            raise ValueError(f"api_server_count must be at least 1; got {self.api_server_count}")
        if not 0 <= self.api_server_index < self.api_server_count:
            raise ValueError(f"api_server_index must be in [0, {self.api_server_count}); got {self.api_server_index}")
        if self.api_server_count > 1 and self.data_parallel_backend == "ray":
            raise ValueError("--api-server-count > 1 runs with --data-parallel-backend mp only, for now")

    def for_rank(self, rank: int, restarts: int = 0) -> ParallelConfig:
        """This config as the engine core of `rank` gets it (its `restarts` so far)."""
        return dataclasses.replace(self, data_parallel_rank=rank, engine_restarts=restarts)


def _graph_sizes(text: str) -> list[int]:
    """`"1,2,4"` -> [1, 2, 4] (the --cuda-graph-sizes flag)."""
    return [int(item) for item in comma_list(text)]


@dataclass(frozen=True)
class DeviceConfig:
    """Where each rank runs and how its GPU memory and decode steps are set up."""

    device: str = opt("auto", "Device of every rank: cuda (rank r on GPU r), cpu, or auto (cuda when present).",
                      choices=_DEVICES)
    gpu_memory_utilization: float = opt(
        0.9, "On CUDA, the share of each GPU's memory mmserve may use: weights, the activations of the largest "
        "step (profiled at start) and the KV cache, which gets the rest (--num-kv-blocks overrides it, as does "
        "an explicit --kv-cache-memory-gb). Ignored on CPU.")
    enforce_eager: bool = opt(False, "Never capture CUDA graphs, and on the CPU never run a decode step's layers "
                              "in one compiled C call: every decode step runs layer by layer.")
    cuda_graph_sizes: list[int] = opt(
        [], "Decode batch sizes captured as CUDA graphs, comma-separated (default: 1, 2, 4, 8 and multiples "
        "of 8 up to --max-num-seqs); a batch runs in the smallest graph that holds it, padded.",
        parse=_graph_sizes)

    def __post_init__(self) -> None:
        if self.device not in _DEVICES and self.device != "meta":  # meta: structure only (device tests)
            raise ValueError(f"device must be one of {', '.join(_DEVICES)}; got {self.device!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1]; got {self.gpu_memory_utilization}")
        if any(size < 1 for size in self.cuda_graph_sizes):
            raise ValueError(f"cuda_graph_sizes must be positive; got {self.cuda_graph_sizes}")

    def graph_sizes(self, max_num_seqs: int) -> list[int]:
        """The decode batch sizes to capture, ascending (the flag's, else 1, 2, 4, 8, 16, ...)."""
        if self.cuda_graph_sizes:
            return sorted(set(self.cuda_graph_sizes))
        sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs + 8, 8))
        return sorted({min(s, max_num_seqs) for s in sizes})
