"""`mmserve` command line: `mmserve serve` (the OpenAI-compatible server), `mmserve bench` (benchmarks),
`mmserve generate` (offline)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

from mmserve.bench.cli import add_bench_parser, run_bench, split_server_args
from mmserve.config import EngineConfig, add_cli_args, engine_args_from_cli
from mmserve.config.config_file import with_config_file
from mmserve.config.vllm_argv import json_flags, vllm_argv
from mmserve.config.vllm_flags import add_vllm_flags, vllm_flag_notes
from mmserve.gc_tuning import pause_collection


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mmserve", description="Serve vision-language models with caching.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = _add_serve_parser(sub)
    add_bench_parser(sub)
    gen = sub.add_parser("generate", help="Complete one prompt about one image, offline.")
    gen.add_argument("--image", default=None, help="Image file (default: a built-in sample picture).")
    gen.add_argument("--prompt", default="What is in this image?", help="The user's message.")
    gen.add_argument("--max-tokens", type=int, default=32, help="Most tokens to generate.")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy.")
    add_cli_args(gen)
    argv, server_args = split_server_args(sys.argv[1:] if argv is None else list(argv))
    try:
        if argv[:1] == ["serve"]:  # vLLM's spellings: --max_model_len, --limit-mm-per-prompt.video 0
            argv = vllm_argv(argv, json_flags(serve))
        args = with_config_file(parser, serve, argv)  # serve's --config FILE.yaml: its flags first
    except ValueError as e:
        print(f"mmserve: error: {e}", file=sys.stderr)
        return 2
    if args.command == "bench":
        args.server_args = server_args
        return run_bench(args)
    ctrl_c = CtrlC()
    try:
        with ctrl_c:
            return _serve(args) if args.command == "serve" else _generate(args)
    except KeyboardInterrupt:  # Ctrl-C before the server serves (its imports, the model's load): a quiet stop
        CtrlC.stopped = True
        return 0
    except Exception as e:
        if ctrl_c.pressed:  # a library turned the Ctrl-C into its own error (pydantic-core's SchemaError)
            CtrlC.stopped = True
            return 0
        if not isinstance(e, ValueError):
            raise
        print(f"mmserve: error: {e}", file=sys.stderr)
        return 2


def run() -> None:
    """The `mmserve` program: `main`'s exit code. After a Ctrl-C it leaves at once (`os._exit`, its
    own cleanup done, output flushed): a KeyboardInterrupt that passed through an extension's nested
    `PyRun_*` call while a module was imported (pydantic-core's) sets CPython's "unhandled
    KeyboardInterrupt" flag although `main` caught it, and the interpreter would then kill itself
    with SIGINT as it exits (exit status -2, no output)."""
    code = main()
    if CtrlC.stopped:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


class CtrlC:
    """Within it, where SIGINT has Python's handler, a Ctrl-C raises KeyboardInterrupt and is
    remembered (`pressed`): one raised inside a library's code may come out as another exception
    (pydantic-core builds a model class in Rust and reports a `SchemaError`), and is still a quiet stop.

    Not inside an import: there a KeyboardInterrupt can go through C++ (torch's start aborted the
    process) or a library's catch-all (the start went on and served). A Ctrl-C that lands in an
    import is raised again as soon as the main thread has left it (`_after_import`).
    `stopped`: `main` ended on a Ctrl-C (`run` then exits at once)."""

    stopped = False

    def __init__(self) -> None:
        self.pressed = False
        self._previous: Any = None
        self._deferred = False

    def __enter__(self) -> CtrlC:
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None and signal.getsignal(signal.SIGINT) == self._handle:  # else changed since
            signal.signal(signal.SIGINT, self._previous)

    def _handle(self, signum: int, frame: Any) -> None:
        self.pressed = True
        if _importing(frame):
            if not self._deferred:
                self._deferred = True
                threading.Thread(target=self._after_import, name="mmserve-ctrl-c", daemon=True).start()
            return
        raise KeyboardInterrupt

    def _after_import(self) -> None:
        """Once the main thread is out of every import, send SIGINT again (its handler then raises).
        Should that land in the next import (the main thread was between two), it is deferred again:
        a Ctrl-C is never dropped."""
        main = threading.main_thread().ident
        while main is not None and _importing(sys._current_frames().get(main)):
            time.sleep(0.01)
        self._deferred = False
        signal.raise_signal(signal.SIGINT)


def _importing(frame: Any) -> bool:
    """Whether `frame` runs inside an import (a frame of importlib's machinery below it)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _add_serve_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from mmserve.entrypoints.openai.server_config import add_server_cli_args

    serve = sub.add_parser("serve", help="Serve a model over an OpenAI-compatible HTTP API.",
                           description="Serve a model over an OpenAI-compatible HTTP API: POST /v1/chat/completions, "
                                       "GET /v1/models, GET /health, GET /metrics.")
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="A Hugging Face repo id (Qwen/Qwen2.5-VL-7B-Instruct: downloaded once, or found in the "
                            "Hugging Face cache), a checkpoint directory or a builtin name (overrides --model; "
                            "default builtin:tiny-llava).")
    serve.add_argument("--config", default=None, metavar="FILE.yaml",
                       help="Read flags from a YAML file mapping their names to values ('max-num-seqs: 8'); "
                            "the command line's own win (vLLM's flag).")
    serve.add_argument("--hf-token", nargs="?", const=True, default=None, metavar="TOKEN",
                       help="Hugging Face token for gated or private repos (default: HF_TOKEN, else the one "
                            "`hf auth login` stored; vLLM's flag).")
    add_server_cli_args(serve)
    add_cli_args(serve)
    add_vllm_flags(serve)  # a vLLM command line runs: each of its flags done, without effect, or refused by name
    return serve


def _serve(args: argparse.Namespace) -> int:
    pause_collection()  # until the server serves (`ServingProcess.serve`); else it exits
    if args.model_tag is not None:
        args.model = args.model_tag
    if isinstance(args.hf_token, str):  # read by huggingface_hub here and in every process started from here
        os.environ["HF_TOKEN"] = args.hf_token
    for note in vllm_flag_notes(args):  # a refused one raises: `mmserve: error: ...`
        print(f"mmserve: {note}", file=sys.stderr)
    try:
        return run_server(args)
    except RuntimeError as e:  # the engine core could not start
        print(f"mmserve: error: {e}", file=sys.stderr)
        return 1


def run_server(args: argparse.Namespace) -> int:
    """Serve until SIGTERM / Ctrl-C (exit 0) or the engine core's death (`ENGINE_DEAD_EXIT_CODE`):
    one API server here, or with --api-server-count > 1 the launcher and its servers.

    ValueError for bad flags; RuntimeError if the engine core cannot start.
    """
    from mmserve.entrypoints.openai.server_config import ServerConfig
    from mmserve.frontend.engine_client.engine_process import discard_prestarted, prestart_engine_core
    from mmserve.models.hub import resolve_engine_model

    server_config = ServerConfig.from_cli(args)
    # the model is downloaded or found here, once, before any other process starts (models/hub.py)
    engine_config = resolve_engine_model(EngineConfig.from_kwargs(**engine_args_from_cli(args)))
    if engine_config.parallel.api_server_count > 1:
        from mmserve.launcher.launcher import run_launcher

        return run_launcher(server_config, engine_config)
    from mmserve.entrypoints.openai.listen import listen_socket

    sock = listen_socket(server_config.host, server_config.port)  # a port in use fails now, not after the load
    parallel = engine_config.parallel
    if parallel.data_parallel_size == 1 and parallel.data_parallel_backend == "mp":
        prestart_engine_core()  # its imports run beside the server's, next
    try:
        from mmserve.entrypoints.openai.api_server import serve_api_server

        return serve_api_server(server_config, engine_config, sock=sock)
    finally:
        discard_prestarted()
        sock.close()


def _generate(args: argparse.Namespace) -> int:
    from mmserve import LLM, SamplingParams
    from mmserve.multimodal.sample_image import sample_image

    if args.image is not None and not os.path.isfile(args.image):
        raise ValueError(f"--image {args.image!r} is not a file")
    image = args.image and "file://" + os.path.realpath(args.image)
    # unset (None) flags keep the offline API's defaults (e.g. local files readable)
    llm = LLM(**{k: v for k, v in engine_args_from_cli(args).items() if v is not None})
    messages = [{"role": "user", "content": [
        {"type": "image", "image": image or sample_image()},
        {"type": "text", "text": args.prompt},
    ]}]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    out = llm.chat(messages, params)[0]
    print(out.outputs[0].text)
    return 0


if __name__ == "__main__":
    run()
