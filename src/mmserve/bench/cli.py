"""`mmserve bench serve` and `mmserve bench components`: their flags, shaped like `vllm bench serve`."""

from __future__ import annotations

import argparse
import sys

DATASETS = ("random-mm", "jsonl", "image-dir")


def split_server_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """`mmserve bench serve ... -- SERVER FLAGS`: (the bench's own argv, the server flags after `--`)."""
    if argv[:1] != ["bench"] or "--" not in argv:
        return argv, []
    i = argv.index("--")
    return argv[:i], argv[i + 1:]


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    """`mmserve bench {serve,components}`."""
    bench = sub.add_parser("bench", help="Benchmark a server (serve) or the engine's parts (components).",
                           description="Benchmarks: 'serve' sends a workload to a server and reports each run; "
                                       "'components' runs the scripts in benchmarks/.")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    serve = kinds.add_parser(
        "serve", help="Send a multimodal workload to a server, K times, and report latency and cache hit rates.",
        description="Send chat requests with images to an OpenAI-compatible server, --repeat K times (a cold run, "
                    "then warm runs), and report throughput, TTFT, TPOT, ITL and each cache layer's hit rate per "
                    "run. Server flags for --launch may also follow a '--'.")
    _add_server_flags(serve)
    _add_dataset_flags(serve)
    _add_load_flags(serve)
    _add_output_flags(serve)
    components = kinds.add_parser(
        "components", help="Run the component benchmarks in benchmarks/ (each prints its target and ratio).")
    components.add_argument("--only", action="append", default=None, metavar="NAME",
                            help="Run only this benchmark (a script name without .py; repeat or comma-separate).")
    components.add_argument("--list", action="store_true", help="List the benchmarks found and exit.")
    components.add_argument("--timeout", type=float, default=None, metavar="S",
                            help="Kill a benchmark still running after S seconds (it then counts as failed).")
    components.add_argument("--dir", default=None, help="The benchmarks folder (default: ./benchmarks, else the "
                                                       "repository's).")


def _add_server_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="The server to benchmark (without --launch).")
    g.add_argument("--endpoint", default="/v1/chat/completions", help="The chat completions path.")
    g.add_argument("--launch", action="store_true",
                   help="Start a server for the benchmark on a free loopback port, and stop it afterwards.")
    g.add_argument("--model", default=None, help="With --launch: the model to serve (default builtin:tiny-llava). "
                                                 "Else: the model name to send (default: the server's first).")
    g.add_argument("--launch-args", default=None, metavar="FLAGS",
                   help='Server flags for --launch, as one string: --launch-args "--mm-processor-cache-gb 0" '
                        '(a lone flag needs the = form: --launch-args=--no-enable-prefix-caching).')
    g.add_argument("--launch-timeout", type=float, default=300.0, help="Seconds to wait for the launched server.")
    g.add_argument("--api-key", default=None, help="Sent as 'Authorization: Bearer KEY'.")


def _add_dataset_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset-name", default="random-mm", choices=DATASETS,
                   help="random-mm: seeded synthetic images; jsonl: a file of OpenAI message lists; "
                        "image-dir: a folder of images, each asked generated questions.")
    g.add_argument("--dataset-path", default=None, help="The jsonl file or the image folder.")
    g.add_argument("--num-prompts", type=int, default=None,
                   help="Requests per run (default: 64 for random-mm, the whole file or folder otherwise).")
    g.add_argument("--image-size", default="336",
                   help="random-mm: image size, N or WxH pixels; a comma list (224,640x480) mixes sizes, new images "
                        "taking them in turn.")
    g.add_argument("--images-per-prompt", type=int, default=1, help="random-mm: images in each request.")
    g.add_argument("--input-len", type=int, default=32, help="random-mm: words of text per request "
                                                              "(about one token each; usage has exact counts).")
    g.add_argument("--output-len", type=int, default=32, help="Tokens to generate per request (max_tokens).")
    g.add_argument("--image-repeat-rate", type=float, default=0.0,
                   help="random-mm: the fraction of prompts whose images already appeared in an earlier prompt.")


def _add_load_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("load")
    g.add_argument("--max-concurrency", type=int, default=None, help="Most requests in flight (default: no cap).")
    g.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Requests per second, Poisson arrivals (default inf: all at once).")
    g.add_argument("--seed", type=int, default=0, help="Seed of the dataset and of the arrival times.")
    g.add_argument("--repeat", type=int, default=1, metavar="K",
                   help="Send the same requests K times: a cold run, then K-1 warm runs.")
    g.add_argument("--temperature", type=float, default=0.0, help="Sampling temperature (0: greedy).")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="Generate exactly --output-len tokens (default on).")
    g.add_argument("--request-timeout", type=float, default=600.0, help="Seconds before a request counts as failed.")


def _add_output_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--save-result", default=None, metavar="FILE", help="Write the runs' figures as JSON.")
    g.add_argument("--plot", default=None, metavar="FILE.png",
                   help="Draw TTFT per run and hit rates per cache layer (needs matplotlib).")
    g.add_argument("--no-progress", "--disable-tqdm", dest="no_progress", action="store_true",
                   help="No progress bar on stderr.")


def run_bench(args: argparse.Namespace) -> int:
    """Dispatch `mmserve bench ...`; errors print one line and return non-zero."""
    try:
        if args.bench_command == "components":
            from mmserve.bench.components import run_components

            return run_components(args.dir, _names(args.only), list_only=args.list, timeout_s=args.timeout)
        from mmserve.bench.serve import run_bench_serve

        return run_bench_serve(args)
    except ValueError as e:
        print(f"mmserve bench: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # a server that cannot be launched or reached, no matplotlib
        print(f"mmserve bench: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("mmserve bench: interrupted", file=sys.stderr)
        return 130


def _names(only: list[str] | None) -> list[str] | None:
    if only is None:
        return None
    return [name.strip().removesuffix(".py") for item in only for name in item.split(",") if name.strip()]
