"""Configuration: one frozen dataclass per layer; CLI flags and their help come from the fields.

Every field's `metadata["help"]` is its flag's help text; `--snake-case` of the field name is the
flag, and the same snake_case name is the offline engine argument (`LLM(max_num_seqs=8)`).
Derived values are properties; validation lives in `__post_init__`.

The layers, a module each: `model.py`, `cache.py`, `scheduler.py`, `multimodal.py`, `parallel.py`
(ranks and device); `engine.py` holds them all (`EngineConfig`), `cli.py` makes the flags,
`fields.py` what the layers share.
"""

from mmserve.config.cache import CacheConfig
from mmserve.config.cli import add_cli_args, engine_args_from_cli
from mmserve.config.engine import EngineConfig
from mmserve.config.fields import check_finite
from mmserve.config.model import ModelConfig
from mmserve.config.multimodal import MultiModalConfig
from mmserve.config.parallel import DeviceConfig, ParallelConfig
from mmserve.config.scheduler import SchedulerConfig, compute_encoder_budget

__all__ = ["CacheConfig", "DeviceConfig", "EngineConfig", "ModelConfig", "MultiModalConfig", "ParallelConfig",
           "SchedulerConfig", "add_cli_args", "check_finite", "compute_encoder_budget", "engine_args_from_cli"]
