"""`mmserve` command line: `mmserve generate` (one completion, offline)."""

from __future__ import annotations

import argparse
import os
import sys

from mmserve.config import add_cli_args, engine_args_from_cli


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mmserve", description="Serve vision-language models with caching.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="Complete one prompt about one image, offline.")
    gen.add_argument("--image", default=None, help="Image file (default: a built-in sample picture).")
    gen.add_argument("--prompt", default="What is in this image?", help="The user's message.")
    gen.add_argument("--max-tokens", type=int, default=32, help="Most tokens to generate.")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy.")
    add_cli_args(gen)
    args = parser.parse_args(argv)
    try:
        return _generate(args)
    except ValueError as e:
        print(f"mmserve: error: {e}", file=sys.stderr)
        return 2


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
    sys.exit(main())
