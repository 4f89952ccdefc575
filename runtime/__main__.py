"""`python -m runtime --engine_dir DIR --prompt TEXT [--image FILE] [--audio FILE]`: generate and stream."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from .llm import LLM
from .params import SamplingParams


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m runtime", description=__doc__)
    ap.add_argument("--engine_dir", required=True)
    ap.add_argument("--prompt", required=True, help="text; <|image|> and <|audio|> mark where media go")
    ap.add_argument("--image", action="append", default=[], help="PNG or JPEG file (repeatable)")
    ap.add_argument("--audio", action="append", default=[], help="WAV file (repeatable)")
    ap.add_argument("--max_tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top_k", type=int, default=0)
    ap.add_argument("--top_p", type=float, default=1.0)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--num_draft_tokens", type=int, default=0, help="MTP drafts per step (0..8)")
    ap.add_argument(
        "--cuda_graphs",
        action=argparse.BooleanOptionalAction,
        help="decode/verify steps as CUDA graphs (default: on for a one-GPU engine with the Triton plugins)",
    )
    args = ap.parse_args(argv)
    try:
        llm = LLM(args.engine_dir, cuda_graphs=args.cuda_graphs)
        params = SamplingParams(
            args.max_tokens, args.temperature, args.top_k, args.top_p, args.seed,
            num_draft_tokens=args.num_draft_tokens,
        )  # fmt: skip
        prompt = {
            "text": args.prompt,
            "images": [open(f, "rb").read() for f in args.image],
            "audios": [open(f, "rb").read() for f in args.audio],
        }
        asyncio.run(_stream(llm, prompt, params))
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


async def _stream(llm: LLM, prompt: dict, params: SamplingParams) -> None:
    start = time.perf_counter()
    first = None
    async for d in llm.stream(prompt, params):
        first = first or time.perf_counter()
        print(d.text, end="", flush=True)
        if d.finish_reason:
            elapsed = time.perf_counter() - start
            print(
                f"\n[{d.completion_tokens} tokens, finish: {d.finish_reason}, prompt {d.prompt_tokens} tokens, "
                f"first token {first - start:.2f} s, {d.completion_tokens / elapsed:.1f} tokens/s]"
            )


if __name__ == "__main__":
    sys.exit(main())
