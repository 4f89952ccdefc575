"""The engine process's child: `python -m runtime.engine_child`, started by EngineProcess
(runtime/engine_process.py). It loads the engine (an LLM), says "ready", then steps it, reading the parent's
messages between steps; a data-parallel replica steps in lockstep with the others (runtime/data_parallel.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import pickle
import sys
import traceback
from multiprocessing.connection import Connection

import torch

from .data_parallel import IDLE_POLL_S
from .engine import StreamDelta
from .engine_process import SWITCH
from .llm import LLM


def serve(conn: Connection, llm_args: dict) -> None:
    """Load the engine, say "ready", then step it, reading the parent's messages between steps, until
    "stop" or the parent is gone."""
    try:
        llm = LLM(**llm_args)
    except BaseException as e:
        conn.send_bytes(pickle.dumps(("failed", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")))
        raise
    engine = llm.engine

    def send(kind: str, deltas: list[StreamDelta]) -> None:
        conn.send_bytes(pickle.dumps((kind, deltas, engine.cache_stats()), protocol=pickle.HIGHEST_PROTOCOL))

    conn.send_bytes(pickle.dumps(("ready", engine.cache_stats())))
    # A data-parallel replica steps while any replica has work (its step programs meet the others' in the
    # MoE) and stops when any is told to (runtime/data_parallel.py).
    dp = llm.dp
    world_busy = stopping = False
    try:
        while True:
            out: list[StreamDelta] = []
            busy = engine.has_unfinished() or world_busy
            # Idle: sleep until the parent writes (a replica: a short while, then agree again). Busy: take what
            # has come, without waiting.
            wait = 0 if busy else (None if dp is None else IDLE_POLL_S)
            while not stopping and conn.poll(wait):
                message = pickle.loads(conn.recv_bytes())
                if message[0] == "stop":
                    stopping = True
                    break
                out += _handle(engine, message)
                wait = 0
            if dp is not None:
                world_busy, stop_all = dp.agree(int(engine.has_unfinished()), int(stopping))
                stopping = bool(stop_all)
            if stopping:
                send("stopped", out + engine.abort_all())
                return
            if engine.has_unfinished() or world_busy:
                try:
                    out += engine.step()
                except Exception as e:  # the engine's own fault, not one request's: end what runs, go on
                    traceback.print_exc()
                    out += [
                        dataclasses.replace(d, finish_reason="error", error=f"engine failure: {e}")
                        for d in engine.abort_all()
                    ]
            if out:
                send("step", out)
    except (EOFError, OSError):
        pass  # the parent is gone
    finally:
        llm.shutdown()


def _handle(engine, message: tuple) -> list[StreamDelta]:
    """An "add" (of one or more requests) or an "abort" from the parent: the deltas it ends with at once
    (rejections, an abort)."""
    kind, arg = message
    if kind == "abort":
        deltas = [engine.abort_request(arg)]
    else:
        deltas = [engine.try_add_request(rid, prompt, params) for rid, prompt, params in arg]
    return [d for d in deltas if d is not None]


def main(argv: list[str] | None = None) -> None:
    args, llm_args = parse_args(argv)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    serve(Connection(args.fd), llm_args)


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, dict]:
    """The child's arguments, and LLM's keyword arguments from them."""
    p = argparse.ArgumentParser(prog="python -m runtime.engine_child", description=__doc__.split("\n\n")[0])
    p.add_argument("--engine_dir", required=True)
    p.add_argument("--fd", type=int, required=True, help="this end of the parent's socket pair")
    p.add_argument("--num_blocks", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num_threads", type=int, default=0)
    p.add_argument("--cuda_graphs", choices=list(SWITCH.values()), default="auto")
    p.add_argument("--overlap", choices=list(SWITCH.values()), default="auto")
    p.add_argument("--max_prefill_pairs", type=int, default=0, help="LLM's (0: None)")
    p.add_argument("--decode_slowdown", type=float, default=0.0, help="LLM's (0: None)")
    p.add_argument("--dp_rank", type=int, default=None, help="a data-parallel replica's rank")
    p.add_argument("--dp_store", default=None, help="the replicas' rendezvous store, HOST:PORT")
    p.add_argument("--pad_eager", action="store_true", help="the step graphs' buckets, run eager (tests)")
    args = p.parse_args(argv)
    switch = {v: k for k, v in SWITCH.items()}
    llm_args = dict(
        engine=args.engine_dir,
        num_blocks=args.num_blocks or None,
        seed=args.seed,
        cuda_graphs=switch[args.cuda_graphs],
        overlap=switch[args.overlap],
        max_prefill_pairs=args.max_prefill_pairs or None,
        decode_slowdown=args.decode_slowdown or None,
        dp=None if args.dp_rank is None else (args.dp_rank, args.dp_store),
        pad_eager=args.pad_eager,
    )
    return args, llm_args


if __name__ == "__main__":
    sys.exit(main())
