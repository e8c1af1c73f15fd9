"""What each layer's config is made of: a field with its flag's help (`opt`), and the checks
and parsers the layers share."""

from __future__ import annotations

import math
from dataclasses import field, fields
from typing import Any


def opt(default: Any, help: str, **kw: Any) -> Any:
    """A config field: its default and its flag's help (`metadata["help"]`), and the flag's
    `parse`, `choices`, `action` or `cli=False` where given."""
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


def check_finite(config: Any) -> None:
    """ValueError naming the first float field of a config dataclass that is NaN or infinite."""
    for f in fields(config):
        value = getattr(config, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{f.name} (--{f.name.replace('_', '-')}) must be a finite number; got {value}")


def comma_list(text: str) -> list[str]:
    """`"a.com, b.com"` -> `["a.com", "b.com"]` (blank items dropped)."""
    return [item.strip() for item in text.split(",") if item.strip()]
