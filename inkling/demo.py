"""`make demo`: a text+image+audio prompt through the reference model of a (synthetic) checkpoint.

    python -m inkling.demo --model_dir build/inkling-tiny [--image FILE] [--audio FILE]

Without files it makes a small gradient PNG and a one-second 440 Hz WAV in memory.
"""

from __future__ import annotations

import argparse
import io
import math
import struct
import time
import wave

import torch

from .model import InklingReference
from .processing import Processor
from .tokenizer import load_tokenizer

PROMPT = "Describe the picture <|image|> and the sound <|audio|> in one sentence."


def demo_png(width: int = 48, height: int = 40) -> bytes:
    from PIL import Image

    img = Image.new("RGB", (width, height))
    img.putdata([(4 * x % 256, 6 * y % 256, (x * y) % 256) for y in range(height) for x in range(width)])
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def demo_wav(seconds: float = 1.0, rate: int = 22050, freq: float = 440.0) -> bytes:
    n = int(seconds * rate)
    samples = (int(12000 * math.sin(2 * math.pi * freq * i / rate)) for i in range(n))
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(b"".join(struct.pack("<h", s) for s in samples))
    return buf.getvalue()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model_dir", required=True)
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--image", help="a PNG or JPEG file (default: a generated gradient)")
    ap.add_argument("--audio", help="a WAV file (default: a generated 440 Hz tone)")
    ap.add_argument("--max_new_tokens", type=int, default=16)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args(argv)

    image = open(args.image, "rb").read() if args.image else demo_png()
    audio = open(args.audio, "rb").read() if args.audio else demo_wav()
    model = InklingReference.from_pretrained(args.model_dir, dtype=getattr(torch, args.dtype))
    tokenizer = load_tokenizer(args.model_dir)
    prompt = Processor(model.config, tokenizer)(args.prompt, images=[image], audios=[audio])
    print(f"prompt: {args.prompt!r}")
    print(
        f"  {len(prompt.input_ids)} tokens, image {tuple(prompt.images[0].shape)}, audio levels {tuple(prompt.audios[0].shape)}"
    )
    start = time.perf_counter()
    new = model.generate(prompt.input_ids, args.max_new_tokens, images=prompt.images, audios=prompt.audios)
    elapsed = time.perf_counter() - start
    print(f"generated token ids: {new.tolist()}")
    print(f"generated text: {tokenizer.decode(new.tolist(), skip_special_tokens=False)!r}")
    print(
        f"({len(new)} tokens in {elapsed:.2f} s with the reference model; random weights, so the text is noise)"
    )


if __name__ == "__main__":
    main()
