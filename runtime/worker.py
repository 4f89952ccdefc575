"""A tensor-parallel worker: rank r > 0 of an engine, started by rank 0 (runtime/distributed.py).

    python -m runtime.worker --engine_dir DIR --rank R --world_size N --store HOST:PORT [--num_blocks B]
        [--graphs {off,cuda,pad_eager}]

It joins the ranks, loads its part of the engine into a ModelRunner, then makes the calls rank 0 broadcasts
(the step, slot resets, snapshots, rollbacks, the MTP heads' rounds) until rank 0 says "shutdown" or exits.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist

from builder.engine import Engine, read_engine_config

from .distributed import STEP_TIMEOUT, RankGroup
from .model_runner import ModelRunner


def serve(
    engine_dir: str, rank: int, world_size: int, store_addr: str, num_blocks: int | None, graphs: str = "off"
) -> None:
    """Join the ranks, load this rank's part of the engine, then run rank 0's calls until "shutdown"."""
    host, port = store_addr.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), world_size, is_master=False, timeout=STEP_TIMEOUT)
    store.set(f"started/{rank}", "1")
    config = read_engine_config(engine_dir)
    device = config["device"]
    if device == "cpu":  # the ranks share the host's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    collectives = config["plugin_config"]["impls"].get("collectives", "reference")
    group = RankGroup.join(store, rank, world_size, device, collectives)
    engine = Engine.from_dir(engine_dir, rank=rank, world_size=world_size)
    runner = ModelRunner(engine, num_blocks, cuda_graphs=graphs == "cuda", pad_eager=graphs == "pad_eager")
    with torch.no_grad():
        while True:
            method, args, reply = group.receive_call()
            if method == "shutdown":
                break
            result = getattr(runner, method)(*args)
            if reply:
                dist.gather_object(result, None, dst=0, group=group.control)
    runner.drop_graphs()
    group.leave()


def _exit_with_parent() -> None:
    """A worker must not outlive rank 0 (killed, crashed): it would wait for calls forever."""
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m runtime.worker", description=__doc__)
    ap.add_argument("--engine_dir", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world_size", type=int, required=True)
    ap.add_argument("--store", required=True, help="HOST:PORT of rank 0's TCPStore")
    ap.add_argument("--num_blocks", type=int, default=0)
    ap.add_argument("--graphs", choices=("off", "cuda", "pad_eager"), default="off")
    args = ap.parse_args(argv)
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    try:
        serve(args.engine_dir, args.rank, args.world_size, args.store, args.num_blocks or None, args.graphs)
    except Exception:
        print(f"[tp rank {args.rank}] failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
