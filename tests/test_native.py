"""Our C files: built once per machine into the kernel cache (mmserve/native.py), and shipped."""

from __future__ import annotations

import fnmatch
import shutil
import tomllib
from pathlib import Path

import pytest

from mmserve import native
from mmserve.models.attention import cpu_kernels

ROOT = Path(__file__).resolve().parents[1]


def test_the_library_is_built_once_into_its_cache_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    if shutil.which("cc") is None:
        pytest.skip("no C compiler here")
    monkeypatch.setenv("MMSERVE_KERNEL_CACHE", str(tmp_path))
    built = native.library_path(cpu_kernels.SOURCE)
    assert built.parent == tmp_path and built.exists()
    stamp = built.stat().st_mtime_ns
    assert native.library_path(cpu_kernels.SOURCE) == built and built.stat().st_mtime_ns == stamp  # found, not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [built.name]  # no scratch left behind


def test_without_a_compiler_or_when_turned_off_there_is_no_library(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("MMSERVE_CPU_KERNELS", "0")
    assert not native.enabled()
    monkeypatch.setenv("MMSERVE_CPU_KERNELS", "1")
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with pytest.raises(OSError, match="no C compiler"):
        native.library_path(cpu_kernels.SOURCE)


def test_every_c_file_is_in_the_package_data():
    """A non-editable install carries every source and header our kernels compile from."""
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    src = ROOT / "src"
    missing = []
    for path in [*src.rglob("csrc/*.c"), *src.rglob("csrc/*.h")]:
        package = ".".join(path.parent.parent.relative_to(src).parts)
        name = str(path.relative_to(path.parent.parent))
        if not any(fnmatch.fnmatch(name, pattern) for pattern in package_data.get(package, [])):
            missing.append(str(path.relative_to(src)))
    assert not missing, missing
