"""A run's figures under stable names (`RunReport`), the terminal table and the JSON result file.

Latencies are in milliseconds over the successful requests (None when there is none, or, for
TPOT and ITL, when no request produced two tokens): TTFT, TPOT = (latency - TTFT) / (output
tokens - 1) per request, ITL = every gap between two streamed text chunks, E2EL = the whole
request. Throughputs divide by the run's wall time. `cache_hit_rate[layer]` is the layer's hit
rate during the run (see prometheus.py), None when it answered no query.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mmserve.bench.prometheus import CacheDelta, counter_delta
from mmserve.bench.runner import RunOutcome

SCHEMA_VERSION = 1
_TTFT = "mmserve_time_to_first_token_seconds"  # the server's histogram


@dataclass
class RunReport:
    """One run's figures; the field names are the JSON keys (keep them stable)."""

    run: int
    label: str
    completed: int
    failed: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    total_input_tokens: int
    total_output_tokens: int
    mean_ttft_ms: float | None
    median_ttft_ms: float | None
    p99_ttft_ms: float | None
    server_mean_ttft_ms: float | None  # the server's own TTFT histogram over the run (no HTTP, no client)
    mean_tpot_ms: float | None
    median_tpot_ms: float | None
    p99_tpot_ms: float | None
    mean_itl_ms: float | None
    median_itl_ms: float | None
    p99_itl_ms: float | None
    mean_e2el_ms: float | None
    median_e2el_ms: float | None
    p99_e2el_ms: float | None
    cache_hit_rate: dict[str, float | None]
    cache_queries: dict[str, int | None]
    cache_hits: dict[str, int | None]
    server_requests: dict[str, int | None] = field(default_factory=dict)  # /metrics delta by outcome
    errors: dict[str, int] = field(default_factory=dict)  # error message -> count

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _stats_ms(values: list[float]) -> tuple[float | None, float | None, float | None]:
    """(mean, median, p99) of seconds, in ms; Nones for no values."""
    if not values:
        return None, None, None
    ms = np.asarray(values) * 1000.0
    return float(ms.mean()), float(np.median(ms)), float(np.percentile(ms, 99))


def summarize(run: int, label: str, outcome: RunOutcome, caches: dict[str, CacheDelta]) -> RunReport:
    """The figures of one run."""
    ok = [r for r in outcome.results if r.success]
    duration = max(outcome.duration_s, 1e-9)
    total_in, total_out = sum(r.prompt_tokens for r in ok), sum(r.output_tokens for r in ok)
    ttft = _stats_ms([r.ttft_s for r in ok if r.ttft_s is not None])
    tpot = _stats_ms([(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in ok
                      if r.ttft_s is not None and r.output_tokens > 1])
    itl = _stats_ms([gap for r in ok for gap in r.itl_s])
    e2el = _stats_ms([r.latency_s for r in ok])
    server = {o: _as_int(counter_delta(outcome.before, outcome.after, "mmserve_requests_total", outcome=o))
              for o in ("success", "error", "abort")}
    ttft_sum, ttft_count = (counter_delta(outcome.before, outcome.after, f"{_TTFT}_{kind}")
                            for kind in ("sum", "count"))
    return RunReport(
        run=run, label=label, completed=len(ok), failed=len(outcome.results) - len(ok),
        duration_s=outcome.duration_s, request_throughput=len(ok) / duration,
        output_throughput=total_out / duration, total_token_throughput=(total_in + total_out) / duration,
        total_input_tokens=total_in, total_output_tokens=total_out,
        mean_ttft_ms=ttft[0], median_ttft_ms=ttft[1], p99_ttft_ms=ttft[2],
        server_mean_ttft_ms=1000.0 * ttft_sum / ttft_count if ttft_sum is not None and ttft_count else None,
        mean_tpot_ms=tpot[0], median_tpot_ms=tpot[1], p99_tpot_ms=tpot[2],
        mean_itl_ms=itl[0], median_itl_ms=itl[1], p99_itl_ms=itl[2],
        mean_e2el_ms=e2el[0], median_e2el_ms=e2el[1], p99_e2el_ms=e2el[2],
        cache_hit_rate={layer: d.hit_rate for layer, d in caches.items()},
        cache_queries={layer: d.queries for layer, d in caches.items()},
        cache_hits={layer: d.hits for layer, d in caches.items()},
        server_requests=server,
        errors=dict(Counter(r.error for r in outcome.results if r.error is not None).most_common()))


def _as_int(value: float | None) -> int | None:
    return None if value is None else round(value)


# ---- the terminal table ----------------------------------------------------------------------

_ROWS: tuple[tuple[str, str | None, str], ...] = (  # (title, RunReport field or None for a heading, format)
    ("Successful requests", "completed", "d"), ("Failed requests", "failed", "d"),
    ("Benchmark duration (s)", "duration_s", ".2f"), ("Total input tokens", "total_input_tokens", "d"),
    ("Total generated tokens", "total_output_tokens", "d"),
    ("Request throughput (req/s)", "request_throughput", ".2f"),
    ("Output token throughput (tok/s)", "output_throughput", ".1f"),
    ("Total token throughput (tok/s)", "total_token_throughput", ".1f"),
    ("Time to First Token", None, ""), ("Mean TTFT (ms)", "mean_ttft_ms", ".2f"),
    ("Median TTFT (ms)", "median_ttft_ms", ".2f"), ("P99 TTFT (ms)", "p99_ttft_ms", ".2f"),
    ("Server-side mean TTFT (ms)", "server_mean_ttft_ms", ".2f"),
    ("Time per Output Token (excl. 1st token)", None, ""), ("Mean TPOT (ms)", "mean_tpot_ms", ".2f"),
    ("Median TPOT (ms)", "median_tpot_ms", ".2f"), ("P99 TPOT (ms)", "p99_tpot_ms", ".2f"),
    ("Inter-token Latency", None, ""), ("Mean ITL (ms)", "mean_itl_ms", ".2f"),
    ("Median ITL (ms)", "median_itl_ms", ".2f"), ("P99 ITL (ms)", "p99_itl_ms", ".2f"),
)
TITLE_WIDTH, COLUMN_WIDTH = 40, 18


def format_table(reports: list[RunReport]) -> str:
    """The runs side by side, one column each, with the cache hit rates at the bottom."""
    width = TITLE_WIDTH + COLUMN_WIDTH * len(reports)
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=width, c="="),
             " " * TITLE_WIDTH + "".join(f"{f'run {r.run} ({r.label})':>{COLUMN_WIDTH}}" for r in reports)]
    for title, name, fmt in _ROWS:
        if name is None:
            lines.append("{s:{c}^{n}}".format(s=f" {title} ", n=width, c="-"))
            continue
        lines.append(f"{title:<{TITLE_WIDTH}}" + "".join(_cell(getattr(r, name), fmt) for r in reports))
    lines.append("{s:{c}^{n}}".format(s=" Cache hit rate (hits / queries in the run) ", n=width, c="-"))
    for layer in reports[0].cache_hit_rate if reports else ():
        lines.append(f"{layer:<{TITLE_WIDTH}}" + "".join(_hit_cell(r, layer) for r in reports))
    lines.append("=" * width)
    return "\n".join(lines + _error_lines(reports))


def _cell(value: float | int | None, fmt: str) -> str:
    return f"{'-' if value is None else format(value, fmt):>{COLUMN_WIDTH}}"


def _hit_cell(report: RunReport, layer: str) -> str:
    rate = report.cache_hit_rate.get(layer)
    if rate is None:
        return f"{'-':>{COLUMN_WIDTH}}"
    return f"{f'{100 * rate:.1f}% of {report.cache_queries[layer]}':>{COLUMN_WIDTH}}"


def _error_lines(reports: list[RunReport]) -> list[str]:
    lines = []
    for r in reports:
        for message, count in list(r.errors.items())[:5]:
            lines.append(f"run {r.run}: {count} failed: {message}")
    return lines


def comparison_line(reports: list[RunReport]) -> str | None:
    """`Median TTFT: run 1 (cold) 120.5 ms; run 2 (warm) 30.1 ms (4.00x faster); ...`, or None for one run."""
    first = reports[0] if reports else None
    if len(reports) < 2 or first is None or not first.median_ttft_ms:
        return None
    parts = [f"run {first.run} ({first.label}) {first.median_ttft_ms:.1f} ms"]
    for r in reports[1:]:
        parts.append(f"run {r.run} ({r.label}) {_cell(r.median_ttft_ms, '.1f').strip()} ms"
                     + _speedup(first.median_ttft_ms, r.median_ttft_ms))
    return "Median TTFT: " + "; ".join(parts)


def _speedup(before_ms: float, after_ms: float | None) -> str:
    """` (4.00x faster)`, ` (1.25x slower)`, or nothing without a time."""
    if not after_ms:
        return ""
    ratio = before_ms / after_ms
    return f" ({ratio:.2f}x faster)" if ratio >= 1 else f" ({1 / ratio:.2f}x slower)"


def write_result(path: str | Path, info: dict[str, Any], reports: list[RunReport]) -> None:
    """Write `{"schema_version", **info, "runs": [RunReport.to_dict(), ...]}` as JSON."""
    body = {"schema_version": SCHEMA_VERSION, **info, "runs": [r.to_dict() for r in reports]}
    Path(path).write_text(json.dumps(body, indent=2) + "\n", encoding="utf-8")
