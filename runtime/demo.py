"""`make demo`: a text+image+audio prompt through the tiny engine (runtime), checked against transformers
on the same checkpoint.

    python -m runtime.demo --engine_dir build/engine-tiny --model_dir build/inkling-tiny-nvfp4
"""

from __future__ import annotations

import argparse
import time

import torch

from inkling.demo import demo_png, demo_wav

from .llm import LLM
from .params import SamplingParams


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine_dir", required=True)
    ap.add_argument(
        "--model_dir", help="the checkpoint the engine was built from, to check against transformers"
    )
    ap.add_argument("--max_tokens", type=int, default=16)
    demo(LLM((args := ap.parse_args(argv)).engine_dir), args)


TEXT_PROMPT = (
    "Describe the picture <|content_image|><|unused_200054|> and the sound "
    "<|content_audio_input|><|unused_200053|><|audio_end|> in one sentence."
)


def reference_greedy(model, prompt, max_tokens: int) -> list[int]:
    """transformers' greedy tokens for an inkling.published.processing.Prompt: `generate` hands it the media
    on the first step only, so a generated placeholder id stays a token, as in the engine."""
    media = {}
    if prompt.pixel_values:
        media["pixel_values"] = torch.cat(prompt.pixel_values)
    if prompt.audio_levels:  # clips of different lengths: padded, with their mask
        n = max(a.shape[0] for a in prompt.audio_levels)
        levels = torch.zeros(len(prompt.audio_levels), n, prompt.audio_levels[0].shape[1], dtype=torch.long)
        mask = torch.zeros(len(prompt.audio_levels), n, dtype=torch.bool)
        for i, a in enumerate(prompt.audio_levels):
            levels[i, : a.shape[0]], mask[i, : a.shape[0]] = a, True
        media.update(audio_input_ids=levels, audio_input_ids_mask=mask)
    with torch.no_grad():
        out = model.generate(
            prompt.input_ids[None],
            **media,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
        )
    return out[0, len(prompt.input_ids) :].tolist()


def demo(llm: LLM, args: argparse.Namespace) -> None:
    """The real Inkling: text, a picture and a sound, the media framed by their marker tokens; checked
    against transformers on the checkpoint the engine was built from (NVFP4: its experts dequantized),
    given the same pixel values and dMel levels."""
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    request = {"text": TEXT_PROMPT, "images": [demo_png()], "audios": [demo_wav()]}
    start = time.perf_counter()
    out = llm.generate([request], params)[0]
    elapsed = time.perf_counter() - start
    print(f"prompt: {TEXT_PROMPT!r} + a 48x40 PNG + a 1 s 440 Hz WAV ({out.prompt_tokens} tokens, no BOS)")
    print(f"engine tokens: {out.token_ids}")
    print(f"engine text:   {out.text!r}")
    print(f"({out.completion_tokens} tokens in {elapsed:.2f} s; random weights, so the text is noise)")
    if args.model_dir:
        from inkling.published.reference import reference_model

        ref = reference_model(args.model_dir)
        p = llm.processor(TEXT_PROMPT, request["images"], request["audios"])
        want = reference_greedy(ref, p, args.max_tokens)
        same = sum(a == b for a, b in zip(out.token_ids, want))
        print(f"transformers:  {want}")
        print(f"agreement: {same}/{len(want)} tokens ({llm.engine.runner.dtype} engine against transformers in "
              "float32: bf16 rounding may flip near-ties)")  # fmt: skip


if __name__ == "__main__":
    main()
