"""`mmserve bench serve`: send a workload K times (a cold run, then warm runs) and report each run.

Against `--base-url`, or `--launch`: a server started for the benchmark (`launch.py`) with the
extra server flags given, stopped afterwards. Runs are back to back in one invocation, so a warm
run finds what the cold run left in the server's caches; each run's cache hit rates come from
the /metrics counters scraped around it.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import math
import shlex
import signal
import sys
from typing import Any

from mmserve.bench.client import RequestSettings
from mmserve.bench.dataset_files import image_dir_requests, jsonl_requests
from mmserve.bench.datasets import BenchRequest, parse_image_sizes, random_mm_requests, repeat_rate
from mmserve.bench.launch import LaunchedServer
from mmserve.bench.prometheus import cache_deltas
from mmserve.bench.report import RunReport, comparison_line, format_table, summarize, write_result
from mmserve.bench.runner import LoadShape, run_workload

DEFAULT_MODEL = "builtin:tiny-llava"
DEFAULT_NUM_PROMPTS = 64  # random-mm; the file datasets default to their whole content


def build_requests(args: argparse.Namespace) -> list[BenchRequest]:
    """The dataset `--dataset-name` names, from the parsed flags."""
    if args.dataset_name == "random-mm":
        return random_mm_requests(
            args.num_prompts or DEFAULT_NUM_PROMPTS, image_size=parse_image_sizes(args.image_size),
            images_per_prompt=args.images_per_prompt, input_len=args.input_len, output_len=args.output_len,
            image_repeat_rate=args.image_repeat_rate, seed=args.seed)
    if args.dataset_path is None:
        raise ValueError(f"--dataset-name {args.dataset_name} needs --dataset-path")
    if args.dataset_name == "jsonl":
        return jsonl_requests(args.dataset_path, args.num_prompts, args.output_len)
    return image_dir_requests(args.dataset_path, args.num_prompts, args.output_len, args.seed)


def server_args_of(args: argparse.Namespace) -> list[str]:
    """`--launch-args` split like a shell would, then everything after `--`."""
    server_args = shlex.split(args.launch_args or "") + list(getattr(args, "server_args", None) or [])
    if server_args and not args.launch:
        raise ValueError("--launch-args and arguments after -- are server flags: they need --launch")
    return server_args


def run_bench_serve(args: argparse.Namespace) -> int:
    """The whole command: 0, or 1 if a run completed no request.

    ValueError for bad flags; RuntimeError for a server that cannot be launched or reached.
    """
    if args.repeat < 1:
        raise ValueError(f"--repeat must be at least 1; got {args.repeat}")
    if args.num_prompts is not None and args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be at least 1; got {args.num_prompts}")
    try:
        import httpx  # noqa: F401
    except ImportError:
        raise RuntimeError("mmserve bench serve needs httpx: pip install 'mmserve[bench]'") from None
    if args.plot:
        from mmserve.bench.plot import require_matplotlib

        require_matplotlib()  # fail before the benchmark, not after it
    server_args = server_args_of(args)
    requests = build_requests(args)
    shape = LoadShape(request_rate=args.request_rate, max_concurrency=args.max_concurrency, seed=args.seed,
                      timeout_s=args.request_timeout)
    if not args.launch:
        return _bench(args, args.base_url, requests, shape, server_args)
    from mmserve.models.hub import prefetch

    prefetch(args.model or DEFAULT_MODEL, server_args)  # a download runs (or fails) here, not in the launch wait
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop the server on SIGTERM too
    try:
        with LaunchedServer(args.model or DEFAULT_MODEL, server_args, args.launch_timeout) as server:
            print(f"mmserve bench: launched mmserve {' '.join(server.command[3:])}", file=sys.stderr, flush=True)
            return _bench(args, server.base_url, requests, shape, server_args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _bench(args: argparse.Namespace, base_url: str, requests: list[BenchRequest], shape: LoadShape,
           server_args: list[str]) -> int:
    """Run the workload `--repeat` times against `base_url`, then print, save and plot the reports."""
    base_url = base_url.rstrip("/")
    model = served_model(base_url, args.api_key) if args.launch or args.model is None else args.model
    settings = RequestSettings(url=base_url + args.endpoint, model=model, api_key=args.api_key,
                               temperature=args.temperature, ignore_eos=args.ignore_eos)
    reports = asyncio.run(_runs(base_url, settings, requests, shape, args))
    print(format_table(reports))
    if (line := comparison_line(reports)) is not None:
        print(line)
    if args.save_result:
        write_result(args.save_result, _result_info(args, base_url, model, requests, server_args), reports)
        print(f"mmserve bench: wrote {args.save_result}", file=sys.stderr)
    if args.plot:
        from mmserve.bench.plot import plot_runs

        plot_runs(reports, args.plot, title=f"mmserve bench serve: {model}, {len(requests)} prompts")
        print(f"mmserve bench: wrote {args.plot}", file=sys.stderr)
    return 1 if any(r.completed == 0 for r in reports) else 0  # a run where nothing worked is a failure


async def _runs(base_url: str, settings: RequestSettings, requests: list[BenchRequest], shape: LoadShape,
                args: argparse.Namespace) -> list[RunReport]:
    reports = []
    for run in range(1, args.repeat + 1):
        label = "cold" if run == 1 else "warm"
        outcome = await run_workload(base_url, settings, requests, shape, f"run {run}/{args.repeat} ({label})",
                                     progress=not args.no_progress)
        if outcome.after.error is not None and run == 1:
            print(f"mmserve bench: no cache hit rates: /metrics: {outcome.after.error}", file=sys.stderr)
        reports.append(summarize(run, label, outcome, cache_deltas(outcome.before, outcome.after)))
    return reports


def served_model(base_url: str, api_key: str | None) -> str:
    """The first model name of GET /v1/models; RuntimeError if the server cannot be reached."""
    import httpx

    headers = {} if api_key is None else {"Authorization": f"Bearer {api_key}"}
    try:
        response = httpx.get(base_url + "/v1/models", headers=headers, timeout=10.0)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise RuntimeError(f"cannot read the model name from {base_url}/v1/models ({type(e).__name__}: {e}); "
                           "is a server running there? (or use --launch, or give --model)") from None


def _result_info(args: argparse.Namespace, base_url: str, model: str, requests: list[BenchRequest],
                 server_args: list[str]) -> dict[str, Any]:
    """Everything about the invocation that the JSON result records beside its runs."""
    rate = "inf" if math.isinf(args.request_rate) else args.request_rate
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "base_url": base_url, "model": model, "launched": bool(args.launch), "server_args": server_args,
        "dataset": {"name": args.dataset_name, "path": args.dataset_path, "num_prompts": len(requests),
                    "image_size": args.image_size, "images_per_prompt": args.images_per_prompt,
                    "input_len": args.input_len, "output_len": args.output_len,
                    "image_repeat_rate": args.image_repeat_rate,
                    "measured_image_repeat_rate": repeat_rate(requests)},
        "load": {"request_rate": rate, "max_concurrency": args.max_concurrency, "seed": args.seed,
                 "repeat": args.repeat, "temperature": args.temperature, "ignore_eos": args.ignore_eos},
    }
