"""Checkpoint directories made of links under mmserve's cache: a tokenizer from another revision
(`hub.py: overlay`), a config.json with `--hf-overrides` merged (`hf_overrides.py`). Each is made
once, beside its place, and renamed into it whole, so a concurrent start never sees half of one."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def linked_directory(target: Path, folders: list[str], written: dict[str, str] | None = None) -> str:
    """`target`, holding a link to every file of each of `folders` (a later folder's file over an
    earlier one's) and the files `written` (name -> text) over those; an existing one is reused."""
    if (target / "config.json").exists():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        for folder in folders:
            for entry in os.listdir(folder):
                link = staging / entry
                if link.is_symlink():
                    link.unlink()
                link.symlink_to(os.path.realpath(os.path.join(folder, entry)))
        for name, text in (written or {}).items():
            (staging / name).unlink(missing_ok=True)
            (staging / name).write_text(text)
        try:
            os.rename(staging, target)
        except OSError:  # a concurrent start renamed its identical copy first
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return str(target)
