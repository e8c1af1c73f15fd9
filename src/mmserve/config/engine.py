"""All layers' configs in one (`EngineConfig`), and the flat engine arguments they are built from."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any

from mmserve.config.cache import CacheConfig
from mmserve.config.fields import check_finite
from mmserve.config.model import ModelConfig
from mmserve.config.multimodal import MultiModalConfig
from mmserve.config.parallel import DeviceConfig, ParallelConfig
from mmserve.config.scheduler import SchedulerConfig

LAYERS: dict[str, Any] = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
                          "multimodal": MultiModalConfig, "parallel": ParallelConfig, "device": DeviceConfig}


@dataclass(frozen=True)
class EngineConfig:
    """All layers' configs; each process gets its own copy."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    multimodal: MultiModalConfig = field(default_factory=MultiModalConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)

    def __post_init__(self) -> None:
        for layer in (self.model, self.cache, self.scheduler, self.multimodal, self.parallel, self.device):
            check_finite(layer)

    @property
    def needs_item_hash(self) -> bool:
        """Whether any layer keys on an item's content hash (processor, IPC or shm store, encoder
        cache across requests, prefix blocks); if none does, items get random ids instead."""
        mm = self.multimodal
        return (mm.mm_processor_cache_gb > 0 or mm.ipc_cache_bytes > 0 or mm.uses_shm
                or self.cache.enable_prefix_caching or self.scheduler.encoder_cache_tokens != 0)

    def for_rank(self, rank: int, restarts: int = 0) -> EngineConfig:
        """The config the engine core of data-parallel `rank` (and its workers) runs with."""
        return dataclasses.replace(self, parallel=self.parallel.for_rank(rank, restarts))

    def for_api_server(self, index: int) -> EngineConfig:
        """The config API server `index` runs with."""
        return dataclasses.replace(self, parallel=dataclasses.replace(self.parallel, api_server_index=index))

    @property
    def ipc_cache_bytes_per_server(self) -> int:
        """Each API server's share of the IPC cache: its sender's capacity and that of its receiver
        in every engine core (`MultiModalConfig.ipc_cache_bytes` split evenly)."""
        return self.multimodal.ipc_cache_bytes // self.parallel.api_server_count

    @property
    def processor_cache_bytes_per_server(self) -> int:
        """Each API server's share of `--mm-processor-cache-gb`."""
        return int(self.multimodal.mm_processor_cache_gb * (1 << 30)) // self.parallel.api_server_count

    @classmethod
    def from_kwargs(cls, **engine_args: Any) -> EngineConfig:
        """Build from flat snake_case engine arguments; unknown names are a ValueError."""
        parts: dict[str, dict[str, Any]] = {name: {} for name in LAYERS}
        for key, value in engine_args.items():
            layer = _layer_of(key)
            if layer is None:
                raise ValueError(f"unknown engine argument {key!r}")
            parts[layer][key] = value
        return cls(**{name: LAYERS[name](**kw) for name, kw in parts.items()})


def _layer_of(key: str) -> str | None:
    for name, layer in LAYERS.items():
        if key in {f.name for f in fields(layer)}:
            return name
    return None
