"""The warm path through the server: what a repeated image costs against its first sight.

Three figures, each against its baseline measured in the same run (issue: warm path):
1. a repeated chat request (one photo-like PNG, max_tokens 1) at 672 px and 1344 px: TTFT of the
   repeat / TTFT of the first sight (target <= 0.20);
2. an agent loop re-sending every earlier 1024x768 screenshot each turn: TTFT of turn 6 (1 new + 5
   re-sent) with every cache on / the same turn with every cache off (target <= 0.25), each the
   median of three loops, the two servers side by side taking turns. The
   screenshots are screenshot-like PNGs (panels, text, icons, one photo thumbnail: ~0.2 MB each);
   the same loop with photo-like images (~1.8 MB each, a 17 MB body at turn 6) is printed too, and
   the screenshot loop through two offline `LLM`s taking turns with the two servers (the ratio of
   the model's work alone, no server, in the same window);
3. the server's overhead: median TTFT of a one-image request through HTTP minus the offline
   engine's, taking turns request by request (target < 5 ms; `serving_overhead.py`), printed for
   two clients: httpx (what an OpenAI SDK user sees, with the client's own ~1 ms) and a raw
   socket (the server alone).

Each figure is measured on each of `--models`: by default both built-in families, LLaVA (every
image 336 px, 144 tokens) and Qwen3-VL (dynamic resolution: a 1024x768 screenshot is 234 tokens
and a 5.8 MB processed item); the agent loop with tools runs on Qwen3-VL, whose template renders them.

Run: `PYTHONPATH=src:tests .venv/bin/python benchmarks/warm_path.py [--runs N] [--parts repeat,...] [--models M,...]`.
The repeat figure takes three distinct images per server, each first sight against the median of
three repeats.
Timings on a shared 2-core machine swing: it prints min / median / max over the runs.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import functools
import io
import json
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import httpx

import mmserve  # noqa: F401  (first: sets OMP_WAIT_POLICY before torch loads, as the server's processes have it)
import numpy as np
from PIL import Image

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.dirname(__file__))

BUILTINS = ("builtin:tiny-llava", "builtin:tiny-qwen3-vl")  # the two families: fixed-size and dynamic resolution
OFFLINE_CACHES_OFF = {"mm_processor_cache_gb": 0, "mm_ipc_cache_gb": 0, "enable_prefix_caching": False,
                      "encoder_cache_tokens": 0}  # CACHES_OFF as `LLM` arguments
CACHES_OFF = ("--mm-processor-cache-gb", "0", "--mm-ipc-cache-gb", "0", "--no-enable-prefix-caching",
              "--encoder-cache-tokens", "0")


def photo(seed: int, width: int, height: int) -> str:
    """A photo-like PNG data URL: smooth gradients with fine noise (compresses like a photo)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([128 + 100 * np.sin(x / (37 + 13 * c) + y / (53 + 7 * c) + seed) for c in range(3)], -1)
    pixels = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def screenshot(seed: int, width: int, height: int) -> str:
    """A screenshot-like PNG data URL: flat panels with borders, rows of text-like glyph runs, a
    toolbar of icons and one photo thumbnail (compresses like a desktop screenshot: ~0.1-0.3 MB
    at 1024x768, where `photo` is ~2 MB)."""
    rng = np.random.default_rng(seed)
    pixels = np.full((height, width, 3), 236, np.uint8)
    pixels[:28] = (52, 56, 64)  # title bar
    for i in range(24):  # toolbar icons
        pixels[6:22, 8 + 24 * i:24 + 24 * i] = rng.integers(40, 220, 3)
    for _ in range(6):  # panels: a border and a flat fill
        x0, y0 = rng.integers(0, width - 300), rng.integers(40, height - 200)
        x1, y1 = x0 + rng.integers(150, 300), y0 + rng.integers(80, 200)
        pixels[y0:y1, x0:x1] = (120, 124, 130)
        pixels[y0 + 1:y1 - 1, x0 + 1:x1 - 1] = rng.integers(200, 256, 3)
    for row in range(40, height - 16, 18):  # text: runs of glyph-like strokes
        x = int(rng.integers(8, 60))
        while x < width - 80 and rng.random() < 0.97:
            word = int(rng.integers(12, 70))
            glyphs = rng.random((10, word)) < 0.45
            pixels[row:row + 10, x:x + word][glyphs] = (30, 30, 34)
            x += word + 6
    ty, tx = int(rng.integers(40, height - 160)), int(rng.integers(0, width - 220))
    pixels[ty:ty + 150, tx:tx + 200] = np.clip(rng.normal(128, 40, (150, 200, 3)), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


# an agent's tools, rendered into every turn's prompt (tool_choice "none": the TTFT is the prefill's)
AGENT_TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name} on the screen", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x", "y"]}}}
    for name in ("click", "double_click", "move_to", "scroll")]


def user_turn(urls: list[str], text: str, part: str = "image_url") -> dict:
    """One user message: `urls` as `part` parts, then `text`."""
    parts = [{"type": part, part: {"url": u}} for u in urls]
    return {"role": "user", "content": parts + [{"type": "text", "text": text}]}


def ttft(client: httpx.Client, base_url: str, urls: list[str], text: str = "What is in this image?",
         part: str = "image_url", tools: bool = False) -> float:
    """Seconds to the first streamed token of one chat request with `urls` as image (or `part`) parts."""
    body = {"model": "m", "messages": [user_turn(urls, text, part)], "max_tokens": 1, "stream": True,
            "temperature": 0.0, **({"tools": AGENT_TOOLS, "tool_choice": "none"} if tools else {})}
    return first_token(client, base_url, body)[0]


def first_token(client: httpx.Client, base_url: str, body: dict) -> tuple[float, httpx.Headers]:
    """Seconds to the first streamed token of the chat request `body`, and the response's headers."""
    content = json.dumps(body).encode()  # encoded before the clock starts: the client's cost, not the server's
    start = time.perf_counter()
    with client.stream("POST", base_url + "/v1/chat/completions", content=content,
                       headers={"Content-Type": "application/json"}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                return time.perf_counter() - start, r.headers
    raise RuntimeError("no token came back")


def server(model: str, *flags: str):
    from helpers.server_process import ServerProcess

    return ServerProcess(model, "--served-model-name", "m", "--max-model-len", "4096",
                         "--max-media-bytes", str(64 << 20), "--limit-mm-per-prompt", '{"image": 8}', *flags)


def repeat_ratios(model: str, side: int, run: int, images: int = 3, repeats: int = 3) -> list[tuple[float, float]]:
    """(first sight, median of `repeats` repeats) TTFT in seconds for `images` distinct side x side
    photos, one after another on a fresh server (each first sight a true miss)."""
    s = server(model)
    try:
        with httpx.Client(timeout=300) as client:
            ttft(client, s.base_url, [photo(10_000 + run, 64, 64)])  # warm-up: compile paths, not these images
            pairs = []
            for i in range(images):
                url = photo(images * run + i, side, side)
                first = ttft(client, s.base_url, [url])
                pairs.append((first, statistics.median(ttft(client, s.base_url, [url]) for _ in range(repeats))))
            return pairs
    finally:
        s.stop()


Ask = Callable[[list[str], str], float]  # times one turn: (the screenshots so far, the text) -> seconds


def agent_turn6(model: str, run: int, tools: bool = False, shot: Callable[[int, int, int], str] = screenshot,
                offline: bool = False, loops: int = 3) -> dict[str, float]:
    """Turn 6 of the agent loop (`side_by_side`) on a caches-on and a caches-off server ("on",
    "off"), with `offline` also on two offline `LLM`s in this process ("offline on", "offline
    off": no HTTP, no P0/P1 hops, the ratio of the model's work alone) taking turns with them."""
    with contextlib.ExitStack() as stack:
        asks: dict[str, Ask] = {}
        client = stack.enter_context(httpx.Client(timeout=600))
        for name, flags in (("on", ()), ("off", CACHES_OFF)):
            s = server(model, *flags)
            stack.callback(s.stop)
            asks[name] = functools.partial(_ask_server, client, s.base_url, tools)
        if offline:
            from mmserve import LLM

            for name, kwargs in (("offline on", {}), ("offline off", OFFLINE_CACHES_OFF)):
                llm = LLM(model=model, max_model_len=4096, limit_mm_per_prompt={"image": 8},
                          max_media_bytes=64 << 20, **kwargs)
                stack.callback(llm.shutdown)
                asks[name] = functools.partial(_ask_offline, llm)
        return side_by_side(asks, run, shot, loops)


def _ask_server(client: httpx.Client, base_url: str, tools: bool, shots: list[str], text: str) -> float:
    return ttft(client, base_url, shots, text, tools=tools)


def _ask_offline(llm: Any, shots: list[str], text: str) -> float:
    from mmserve import SamplingParams

    start = time.perf_counter()
    llm.chat([user_turn(shots, text)], SamplingParams(temperature=0.0, max_tokens=1))
    return time.perf_counter() - start


def side_by_side(asks: dict[str, Ask], run: int, shot: Callable[[int, int, int], str],
                 loops: int) -> dict[str, float]:
    """The median seconds of turn 6 over `loops` agent loops, by side: the sides take turns
    request by request, the first rotating turn by turn (this VM's speed drifts by tens of
    percent within a minute: taking turns puts the same drift into every side). Each loop re-sends
    every screenshot of its own so far (1024x768, made by `shot`; no loop shares an image)."""
    names = list(asks)
    took: dict[str, list[float]] = {name: [] for name in names}
    for loop in range(loops):
        shots: list[str] = []
        for turn in range(6):
            shots.append(shot(100 * (loops * run + loop) + turn, 1024, 768))
            first = (loop + turn) % len(names)
            for name in names[first:] + names[:first]:
                last = asks[name](shots, f"turn {turn}: what changed?")
                if turn == 5:
                    took[name].append(last)
    return {name: statistics.median(t) for name, t in took.items()}


def spread(values: list[float]) -> str:
    return f"{min(values):.3f} / {statistics.median(values):.3f} / {max(values):.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(BUILTINS),
                        help="comma-separated; each figure is measured on each (default: both built-in families)")
    parser.add_argument("--runs", type=int, default=3, help="fresh servers per figure")
    parser.add_argument("--parts", default="repeat,agent,tools,overhead",
                        help="which figures to measure (comma-separated)")
    parser.add_argument("--tools-model", default="builtin:tiny-qwen3-vl",
                        help="the agent loop with tools in every turn runs on this model (its template renders them)")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    for model in args.models.split(","):
        measure(model, args.runs, parts)
    if "tools" in parts:
        agent(args.tools_model, args.runs, tools=True)


def measure(model: str, runs: int, parts: set[str]) -> None:
    """The repeat, agent and overhead figures on `model`, each line prefixed with its name."""
    for side in (672, 1344) if "repeat" in parts else ():
        pairs = [pair for run in range(runs) for pair in repeat_ratios(model, side, run)]
        ratios = [again / first for first, again in pairs]
        print(f"[{model}] repeat at {side} px: first {spread([p[0] * 1e3 for p in pairs])} ms, repeat "
              f"{spread([p[1] * 1e3 for p in pairs])} ms; ratio min/median/max {spread(ratios)} (target <= 0.20)")
    if "agent" in parts:
        agent(model, runs)
    if "overhead" in parts:
        adds = [overhead_in_fresh_process(model, run) for run in range(runs)]
        for client, what in (("httpx", "through httpx, the OpenAI SDK's client"),
                             ("raw", "through a raw socket: the server alone")):
            print(f"[{model}] server overhead {what} (median TTFT of 20 one-image requests, server - offline "
                  f"LLM, taking turns): min/median/max {spread([a[client] * 1e3 for a in adds])} ms (target < 5 ms)")


def agent(model: str, runs: int, tools: bool = False) -> None:
    """Turn 6 of the agent loop, caches on / off, each on `runs` fresh servers: with screenshot-like
    images (the target; without tools also through two offline `LLM`s taking turns with the
    servers, the floor the model's own work sets), and without tools also with photo-like ones
    (~10x the bytes to receive, parse and hash; for context)."""
    kinds = [("screenshots", screenshot)] + ([] if tools else [("photo-like images", photo)])
    for kind, shot in kinds:
        floor = shot is screenshot and not tools
        runs_took = [agent_turn6(model, run, tools, shot, offline=floor) for run in range(runs)]
        label = " with tools" if tools else ""
        sides = [("", "", " (target <= 0.25)" if floor else "")]
        if floor:
            sides.append(("offline ", ", offline LLM (no server: the model's work alone)", ""))
        for side, what, target in sides:
            on, off = [t[side + "on"] for t in runs_took], [t[side + "off"] for t in runs_took]
            print(f"[{model}] agent loop turn 6{label}, {kind}{what}: caches on {spread([t * 1e3 for t in on])} ms, "
                  f"off {spread([t * 1e3 for t in off])} ms; ratio min/median/max "
                  f"{spread([a / b for a, b in zip(on, off)])}{target}")


def overhead_in_fresh_process(model: str, run: int) -> dict[str, float]:
    """`server_overhead` in a new interpreter: its offline baseline runs in the measuring process,
    whose heap must not be one the other parts left pre-faulted (after them the offline engine ran
    ~3 ms faster and the server's overhead read ~3 ms higher, the same code either way)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(server_overhead, model, run).result()


def server_overhead(model: str, run: int, requests: int = 20) -> dict[str, float]:
    """Median TTFT through the server minus the offline engine's, for fresh 336 px images, by
    client ("httpx", "raw"), server and offline requests taking turns (one window, one drift for
    all; see `interleaved_ttfts`)."""
    from serving_overhead import ASKERS, image_url, interleaved_ttfts

    urls = [image_url(1000 * run + i) for i in range(len(ASKERS) * (requests + 1))]
    medians = {asker: statistics.median(t) for asker, t in interleaved_ttfts(model, urls).items()}
    return {client: medians[client] - medians["offline"] for client in ("httpx", "raw")}


if __name__ == "__main__":
    main()
