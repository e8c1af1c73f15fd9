"""The "new question" figure: TTFT of image + question B right after image + question A, through
the server, with partial-block reuse on against off (`--no-enable-partial-block-caching`), in one run.

After question A the image's blocks are cached. Question B shares A's prompt up to a token inside a
block (the chat template, the image, "What is"): with partial blocks off the shared tokens of that
block are computed again (up to 15), with them on they are copied. Each round sends a new photo to
both servers, A then B, the servers taking turns request by request (the machine's drift lands on
both); it prints the median TTFT of B by side, the ratio on / off (target < 1), and one B answer's
`x-mmserve-cache` header (its `partial_block=k/m`: k tokens copied).

Run: `PYTHONPATH=src:tests .venv/bin/python benchmarks/new_question.py [--model M] [--rounds N]`.
The default model is `decode_step.py`'s random-weight Qwen3-VL (text hidden 1024, 12 layers; written
into `--model-dir`, or a temporary folder removed at the end): on the built-in tiny models a step costs the same for
20 tokens as for 35, so they show nothing. `--off-flags ""` makes both sides the plain server (to
time a build without the switch).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import statistics
import sys
import tempfile

import httpx

import mmserve  # noqa: F401  (first: sets OMP_WAIT_POLICY before torch loads, as the server's processes have it)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.dirname(__file__))

from decode_step import TEXT, write_model  # noqa: E402
from warm_path import first_token, photo, server, user_turn  # noqa: E402

QUESTION_A = "What is in this image? Describe it in a few words."
QUESTION_B = "What is the main colour of it?"


def ask(client: httpx.Client, base_url: str, url: str, text: str) -> tuple[float, str]:
    """Seconds to the first streamed token of one image + `text` chat request, and its cache header."""
    body = {"model": "m", "messages": [user_turn([url], text)], "max_tokens": 1, "stream": True, "temperature": 0.0}
    seconds, headers = first_token(client, base_url, body)
    return seconds, headers.get("x-mmserve-cache", "")


def rounds(base_urls: dict[str, str], n: int, size: tuple[int, int]) -> tuple[dict[str, list[float]], dict[str, str]]:
    """Per side, the TTFT of question B in each of `n` rounds, and its last cache header."""
    took: dict[str, list[float]] = {name: [] for name in base_urls}
    headers: dict[str, str] = {}
    names = list(base_urls)
    with httpx.Client(timeout=600) as client:
        for name in names:
            ask(client, base_urls[name], photo(99_999, *size), QUESTION_A)  # warm-up: not timed
        for i in range(n):
            url = photo(1_000 + i, *size)
            order = names[i % len(names):] + names[:i % len(names)]
            for name in order:
                ask(client, base_urls[name], url, QUESTION_A)
            for name in order:
                seconds, headers[name] = ask(client, base_urls[name], url, QUESTION_B)
                took[name].append(seconds)
    return took, headers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="the served model (default: decode_step.py's)")
    parser.add_argument("--model-dir", default=None, help="where decode_step.py's model is written (once)")
    parser.add_argument("--rounds", type=int, default=7, help="photos, each asked A then B on both servers")
    parser.add_argument("--size", default="1024x768", help="the photos' width x height in pixels")
    parser.add_argument("--off-flags", default="--no-enable-partial-block-caching",
                        help="the baseline server's flags (\"\": the plain server)")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        model = args.model or write_model(dict(TEXT), args.model_dir or stack.enter_context(
            tempfile.TemporaryDirectory(prefix="new-question-")))
        urls = {}
        for name, flags in (("on", ()), ("off", tuple(shlex.split(args.off_flags)))):
            s = server(model, *flags)
            stack.callback(s.stop)
            urls[name] = s.base_url
        width, height = (int(v) for v in args.size.split("x"))
        took, headers = rounds(urls, args.rounds, (width, height))
    on, off = (statistics.median(took[name]) for name in ("on", "off"))
    name = args.model or "decode_step.py's model"
    print(f"[{name}] new question (image + B after image + A, {args.size} px, {args.rounds} rounds): "
          f"partial blocks on {on * 1e3:.1f} ms, off {off * 1e3:.1f} ms (medians); ratio {on / off:.3f} (target < 1)")
    for name in ("on", "off"):
        print(f"  {name}: TTFT ms {sorted(round(t * 1e3, 1) for t in took[name])}; x-mmserve-cache: {headers[name]}")


if __name__ == "__main__":
    main()
