"""`make demo`'s last step: serve the engine on Triton, send one text+image+audio request over gRPC
streaming with tritonclient, print the answer as it streams, shut the server down.

    python -m model_repo.demo --engine_dir build/engine-tiny
"""

from __future__ import annotations

import argparse
import queue
import time

import numpy as np
import tritonclient.grpc as grpcclient

from inkling.demo import demo_png, demo_wav
from runtime.demo import TEXT_PROMPT

from .serve import ServeConfig, TritonServer, free_port


def request_inputs(text: str, images: list[bytes], audios: list[bytes], max_tokens: int) -> list:
    out = []
    for name, array, dtype in (
        ("text_input", np.array([text.encode()], dtype=np.object_), "BYTES"),
        ("image_data_input", np.array(images, dtype=np.object_), "BYTES"),
        ("audio_data_input", np.array(audios, dtype=np.object_), "BYTES"),
        ("max_tokens", np.array([max_tokens], dtype=np.int32), "INT32"),
        ("stream", np.array([True]), "BOOL"),
    ):
        if array.size == 0:  # no media: the inputs are optional
            continue
        x = grpcclient.InferInput(name, list(array.shape), dtype)
        x.set_data_from_numpy(array)
        out.append(x)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine_dir", required=True)
    ap.add_argument("--max_tokens", type=int, default=16)
    args = ap.parse_args(argv)
    cfg = ServeConfig(
        engine_dir=args.engine_dir, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port()
    )
    print(f"starting Triton on {cfg.grpc_url} (gRPC) and {cfg.http_url} (HTTP) ...", flush=True)
    text = TEXT_PROMPT
    images, audios = [demo_png()], [demo_wav()]
    what = " + a 48x40 PNG + a 1 s 440 Hz WAV"
    with TritonServer(cfg):
        responses: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(cfg.grpc_url)
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        start = time.perf_counter()
        client.async_stream_infer("ensemble", request_inputs(text, images, audios, args.max_tokens))
        print(f"prompt: {text!r}{what}\nstreamed answer: ", end="", flush=True)
        while True:
            result, error = responses.get(timeout=300)
            if error is not None:
                raise SystemExit(f"\nerror from the server: {error}")
            print(result.as_numpy("text_output")[0].decode(), end="", flush=True)
            finish = result.as_numpy("finish_reason")[0].decode()
            if finish:
                tokens = int(result.as_numpy("completion_tokens")[0])
                print(f"\n[{tokens} tokens, finish: {finish}, {time.perf_counter() - start:.2f} s through Triton; "
                      "random weights, so the text is noise]")  # fmt: skip
                break
        client.stop_stream()
        client.close()


if __name__ == "__main__":
    main()
