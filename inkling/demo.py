"""The demo's media, made in memory: a small gradient PNG and a 440 Hz WAV (`make demo`, tests)."""

from __future__ import annotations

import io
import math
import struct
import wave


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
