"""`mmserve bench components` / `python -m benchmarks`: discovery, --only, the summary, failures."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mmserve.bench.components import discover, run_components
from mmserve.cli import main

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def bench_dir(tmp_path):
    folder = tmp_path / "benchmarks"
    folder.mkdir()
    (folder / "fast_thing.py").write_text("print('fast thing: 2.0 ms vs 6.0 ms, ratio 3.00x (target >= 2x)')\n")
    (folder / "broken.py").write_text("import sys\nprint('starting')\nsys.exit(3)\n")
    (folder / "_helper.py").write_text("raise SystemExit('not a benchmark')\n")
    (folder / "__main__.py").write_text("raise SystemExit('not a benchmark')\n")
    return folder


def test_discovery_skips_private_scripts(bench_dir):
    assert list(discover(bench_dir)) == ["broken", "fast_thing"]


def test_only_runs_the_named_script_and_summarizes(bench_dir, capsys):
    assert main(["bench", "components", "--dir", str(bench_dir), "--only", "fast_thing.py"]) == 0
    out = capsys.readouterr().out
    assert "===== fast_thing (fast_thing.py) =====" in out and "broken" not in out
    assert "fast_thing: ok" in out and "    fast thing: 2.0 ms vs 6.0 ms, ratio 3.00x (target >= 2x)" in out


def test_a_failing_script_fails_the_command(bench_dir, capsys):
    assert run_components(bench_dir, None) == 1
    out = capsys.readouterr().out
    assert "broken: FAILED (exit 3)" in out and "fast_thing: ok" in out and "starting" in out


def test_a_script_past_its_timeout_is_killed(bench_dir, capsys):
    (bench_dir / "stuck.py").write_text("import time\nprint('waiting', flush=True)\ntime.sleep(60)\n")
    assert main(["bench", "components", "--dir", str(bench_dir), "--only", "stuck", "--timeout", "1"]) == 1
    assert "stuck: FAILED (exit -9, killed)" in capsys.readouterr().out


def test_unknown_names_are_refused(bench_dir, capsys):
    assert main(["bench", "components", "--dir", str(bench_dir), "--only", "nope,fast_thing"]) == 2
    assert "no benchmark named nope" in capsys.readouterr().err


def test_python_m_benchmarks_lists_the_repository_scripts():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "benchmarks", "--list"], cwd=REPO, env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    assert {"offline_throughput", "serving_overhead"} <= set(out) and "__main__" not in out
