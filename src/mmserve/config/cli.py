"""The engine's flags: one per config field, help and type from the field."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import fields
from typing import Any, get_type_hints

from mmserve.config.engine import LAYERS


def add_cli_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """Add one flag per config field (`--max-num-seqs`), help and type from the field."""
    for layer in LAYERS.values():
        hints = get_type_hints(layer)
        for f in fields(layer):
            if f.name in skip or not f.metadata.get("cli", True):
                continue
            flag = "--" + f.name.replace("_", "-")
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[operator]
            kw: dict[str, Any] = {"default": default, "help": f.metadata["help"], "dest": f.name}
            if hints[f.name] is bool:
                kw["action"] = argparse.BooleanOptionalAction
            else:
                kw["type"] = f.metadata.get("parse") or _scalar_type(hints[f.name])
                if "choices" in f.metadata:
                    kw["choices"] = f.metadata["choices"]
                if "action" in f.metadata:  # e.g. "extend": a repeatable flag whose parse returns a list
                    kw["action"] = f.metadata["action"]
            parser.add_argument(flag, **kw)


def engine_args_from_cli(ns: argparse.Namespace, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """The engine arguments held by a parsed namespace."""
    return {f.name: getattr(ns, f.name) for layer in LAYERS.values() for f in fields(layer)
            if f.name not in skip and f.metadata.get("cli", True) and hasattr(ns, f.name)}


def _scalar_type(hint: Any) -> Any:
    for t in (int, float, str):
        if hint is t or t in getattr(hint, "__args__", ()):
            return t
    return str
