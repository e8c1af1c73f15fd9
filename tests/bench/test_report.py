"""The benchmark's figures without a server: /metrics parsing, hit rates, summaries, table, JSON, plot."""

from __future__ import annotations

import io
import json
import math
import sys

import pytest

from mmserve.bench.cli import split_server_args
from mmserve.bench.client import RequestResult
from mmserve.bench.plot import INSTALL_HINT, PlotUnavailable, plot_runs, require_matplotlib
from mmserve.bench.progress import ProgressBar
from mmserve.bench.prometheus import MetricsSnapshot, cache_deltas
from mmserve.bench.report import RunReport, comparison_line, format_table, summarize, write_result
from mmserve.bench.runner import LoadShape, RunOutcome
from mmserve.cli import main
from mmserve.ipc.messages import CacheStats, SchedulerStats
from mmserve.metrics import CACHE_LAYERS, ServerMetrics

STABLE_NAMES = ("median_ttft_ms", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "mean_itl_ms", "request_throughput",
                "output_throughput", "completed", "failed", "duration_s", "cache_hit_rate")


def scrape_of(caches: dict[str, CacheStats]) -> MetricsSnapshot:
    """A snapshot parsed from the server's real exposition text."""
    stats = SchedulerStats(num_running=0, num_waiting=0, num_free_blocks=1, num_total_blocks=1, num_preemptions=0,
                           caches=caches)
    return MetricsSnapshot.parse(ServerMetrics(lambda: stats).render().decode())


def test_hit_rates_are_deltas_over_the_run():
    before = scrape_of({"processor": CacheStats(queries=10, hits=2), "prefix": CacheStats(queries=100, hits=0)})
    after = scrape_of({"processor": CacheStats(queries=14, hits=5), "prefix": CacheStats(queries=100, hits=0),
                       "encoder": CacheStats(queries=4, hits=4)})
    deltas = cache_deltas(before, after)
    assert list(deltas) == list(CACHE_LAYERS)
    assert deltas["processor"].hit_rate == 0.75 and deltas["processor"].queries == 4
    assert deltas["encoder"].hit_rate == 1.0
    assert deltas["prefix"].hit_rate is None  # no query during the run
    assert deltas["shm"].hit_rate is None
    assert after.value("mmserve_requests_total", outcome="success") == 0.0
    unreadable = cache_deltas(MetricsSnapshot(error="down"), after)
    assert all(d.hit_rate is None and d.queries is None for d in unreadable.values())


def test_each_ranks_hit_rates_follow_with_data_parallelism():
    def scrape(queries: int, encoder_hits: int, prefix_hits: int) -> MetricsSnapshot:
        text = "".join(f'mmserve_engine_cache_{kind}_total{{engine="{r}",layer="{layer}"}} {value * (int(r) + 1)}\n'
                       for r in ("0", "1") for layer, hits in (("encoder", encoder_hits), ("prefix", prefix_hits))
                       for kind, value in (("queries", queries), ("hits", hits)))
        return MetricsSnapshot.parse(text)

    deltas = cache_deltas(scrape(10, 0, 5), scrape(20, 4, 5))
    assert list(deltas)[len(CACHE_LAYERS):] == ["encoder dp0", "prefix dp0", "encoder dp1", "prefix dp1"]
    assert (deltas["encoder dp0"].hits, deltas["encoder dp0"].queries) == (4, 10)
    assert deltas["encoder dp1"].hit_rate == 8 / 20 and deltas["prefix dp1"].hit_rate == 0.0


def outcome_of(results: list[RequestResult], duration_s: float = 2.0) -> RunOutcome:
    return RunOutcome(results, duration_s, MetricsSnapshot(), MetricsSnapshot())


def test_summarize_counts_and_latencies():
    ok = [RequestResult(True, None, 10, 5, ttft_s=0.1, latency_s=0.5, itl_s=[0.1] * 4),
          RequestResult(True, None, 20, 1, ttft_s=0.3, latency_s=0.3)]
    bad = [RequestResult(False, "HTTP 400: bad image", latency_s=0.01)] * 2
    report = summarize(1, "cold", outcome_of(ok + bad), cache_deltas(MetricsSnapshot(), MetricsSnapshot()))
    assert (report.completed, report.failed, report.total_input_tokens, report.total_output_tokens) == (2, 2, 30, 6)
    assert report.request_throughput == 1.0 and report.output_throughput == 3.0
    assert report.mean_ttft_ms == pytest.approx(200.0) and report.median_ttft_ms == pytest.approx(200.0)
    assert report.mean_tpot_ms == pytest.approx(100.0)  # (0.5 - 0.1) / 4; one-token requests have none
    assert report.mean_itl_ms == pytest.approx(100.0)
    assert report.errors == {"HTTP 400: bad image": 2}
    assert report.cache_hit_rate == {layer: None for layer in CACHE_LAYERS}
    empty = summarize(2, "warm", outcome_of(bad), {})
    assert empty.completed == 0 and empty.median_ttft_ms is None and empty.mean_itl_ms is None
    assert report.server_mean_ttft_ms is None  # no /metrics


def test_server_ttft_is_the_histograms_mean_over_the_run():
    metrics = ServerMetrics()
    metrics.on_request_finished("success", 1, 1, 0.5, 1.0)
    before = MetricsSnapshot.parse(metrics.render().decode())
    metrics.on_request_finished("success", 1, 1, 0.1, 1.0)
    metrics.on_request_finished("success", 1, 1, 0.3, 1.0)
    after = MetricsSnapshot.parse(metrics.render().decode())
    report = summarize(1, "cold", RunOutcome([], 1.0, before, after), {})
    assert report.server_mean_ttft_ms == pytest.approx(200.0)
    assert report.server_requests == {"success": 2, "error": 0, "abort": 0}


def sample_reports() -> list[RunReport]:
    caches = cache_deltas(scrape_of({}), scrape_of({"processor": CacheStats(queries=8, hits=8)}))
    ok = [RequestResult(True, None, 10, 3, ttft_s=0.2, latency_s=0.4, itl_s=[0.1, 0.1])]
    return [summarize(1, "cold", outcome_of(ok), caches), summarize(2, "warm", outcome_of(ok), caches)]


def test_table_and_json_use_the_stable_names(tmp_path):
    reports = sample_reports()
    table = format_table(reports)
    assert "run 1 (cold)" in table and "run 2 (warm)" in table
    assert "100.0% of 8" in table and "Median TTFT (ms)" in table
    assert comparison_line(reports) == "Median TTFT: run 1 (cold) 200.0 ms; run 2 (warm) 200.0 ms (1.00x faster)"
    assert comparison_line(reports[:1]) is None
    reports[1].median_ttft_ms = 400.0
    assert comparison_line(reports).endswith("run 2 (warm) 400.0 ms (2.00x slower)")
    path = tmp_path / "result.json"
    write_result(path, {"model": "m", "load": {"request_rate": "inf"}}, reports)
    body = json.loads(path.read_text())
    assert body["schema_version"] == 1 and body["model"] == "m" and len(body["runs"]) == 2
    for run in body["runs"]:
        assert set(STABLE_NAMES) <= set(run)
        assert run["cache_hit_rate"] == {"processor": 1.0, "ipc": None, "shm": None, "encoder": None, "prefix": None,
                                         "first_token": None}


def test_plot_without_matplotlib_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(PlotUnavailable, match="pip install"):
        require_matplotlib()
    # checked before any request is sent: the unreachable server is never contacted
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--plot", "x.png", "--num-prompts", "1"]) == 1
    assert INSTALL_HINT in capsys.readouterr().err


def test_plot_draws_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    plot_runs(sample_reports(), tmp_path / "runs.png")
    assert (tmp_path / "runs.png").read_bytes()[:4] == b"\x89PNG"


def test_poisson_send_times_are_seeded():
    assert LoadShape().send_times(3) == [0.0, 0.0, 0.0]
    times = LoadShape(request_rate=50.0, seed=1).send_times(2000)
    assert times == LoadShape(request_rate=50.0, seed=1).send_times(2000)
    assert times[0] == 0.0 and all(b >= a for a, b in zip(times, times[1:]))
    assert times[-1] / 1999 == pytest.approx(1 / 50.0, rel=0.1)
    with pytest.raises(ValueError):
        LoadShape(request_rate=0.0)
    assert math.isinf(LoadShape().request_rate)


def test_progress_bar_and_server_args_split():
    out = io.StringIO()
    bar = ProgressBar(4, "run 1/1", stream=out)
    for ok in (True, False, True, True):
        bar.update(ok)
    bar.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 4 and lines[-1].startswith("run 1/1 4/4 [") and "100%" in lines[-1]
    assert "(1 failed)" in lines[-1]
    assert split_server_args(["bench", "serve", "--launch", "--", "--max-model-len", "64"]) == (
        ["bench", "serve", "--launch"], ["--max-model-len", "64"])
    assert split_server_args(["serve", "--", "x"]) == (["serve", "--", "x"], [])


def test_server_flags_need_launch(capsys):
    assert main(["bench", "serve", "--launch-args", "--max-num-seqs 4", "--num-prompts", "1"]) == 2
    assert "need --launch" in capsys.readouterr().err
