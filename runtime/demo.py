"""`make demo`: a text+image+audio prompt through the tiny engine (runtime), checked against the
reference model on the same checkpoint.

    python -m runtime.demo --engine_dir build/engine-tiny --model_dir build/inkling-tiny-nvfp4
"""

from __future__ import annotations

import argparse
import time

import torch

from inkling.demo import PROMPT, demo_png, demo_wav
from inkling.model import InklingReference

from .llm import LLM
from .params import SamplingParams


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine_dir", required=True)
    ap.add_argument(
        "--model_dir", help="the checkpoint the engine was built from, to check against the reference"
    )
    ap.add_argument("--max_tokens", type=int, default=16)
    args = ap.parse_args(argv)

    llm = LLM(args.engine_dir)
    if llm.engine.runner.engine.is_published:
        return published_demo(llm, args)
    request = {"text": PROMPT, "images": [demo_png()], "audios": [demo_wav()]}
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    start = time.perf_counter()
    out = llm.generate(request, params)[0]
    elapsed = time.perf_counter() - start
    print(f"prompt: {PROMPT!r} + a 48x40 PNG + a 1 s 440 Hz WAV ({out.prompt_tokens} tokens)")
    print(f"engine tokens: {out.token_ids}")
    print(f"engine text:   {out.text!r}")
    print(f"({out.completion_tokens} tokens in {elapsed:.2f} s; random weights, so the text is noise)")
    if args.model_dir:
        ref = InklingReference.from_pretrained(args.model_dir, dtype=torch.float32)
        prompt = llm.processor(request["text"], request["images"], request["audios"])
        want = ref.generate(
            prompt.input_ids, args.max_tokens, prompt.images, prompt.audios, stop_ids=[]
        ).tolist()
        same = sum(a == b for a, b in zip(out.token_ids, want))
        print(f"reference:     {want}")
        print(f"agreement: {same}/{len(want)} tokens ({llm.engine.config.torch_dtype} checkpoint, "
              f"{llm.engine.runner.dtype} engine: bf16 rounding may flip near-ties)")  # fmt: skip


TEXT_PROMPT = "The history of the printing press is a story of small improvements"


def published_demo(llm: LLM, args: argparse.Namespace) -> None:
    """The real Inkling: a text prompt (its towers come with the multimodal issue), checked against
    transformers on the checkpoint the engine was built from (NVFP4: its experts dequantized)."""
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    start = time.perf_counter()
    out = llm.generate([TEXT_PROMPT], params)[0]
    elapsed = time.perf_counter() - start
    print(f"prompt: {TEXT_PROMPT!r} ({out.prompt_tokens} tokens, no BOS)")
    print(f"engine tokens: {out.token_ids}")
    print(f"engine text:   {out.text!r}")
    print(f"({out.completion_tokens} tokens in {elapsed:.2f} s; random weights, so the text is noise)")
    if args.model_dir:
        from inkling.published.reference import reference_model

        ref = reference_model(args.model_dir)
        ids = llm.processor(TEXT_PROMPT).input_ids.tolist()
        want = []
        with torch.no_grad():
            for _ in range(args.max_tokens):
                want.append(int(ref(input_ids=torch.tensor([ids + want])).logits[0, -1].argmax()))
        same = sum(a == b for a, b in zip(out.token_ids, want))
        print(f"transformers:  {want}")
        print(f"agreement: {same}/{len(want)} tokens ({llm.engine.runner.dtype} engine against transformers in "
              "float32: bf16 rounding may flip near-ties)")  # fmt: skip


if __name__ == "__main__":
    main()
