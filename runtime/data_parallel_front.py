"""The front of a data-parallel engine (docs/interfaces.md "Data-parallel attention"): its replicas' processes
and the router that picks each request's replica (the replicas' side: runtime/data_parallel.py).

`DataParallelEngine` starts the replicas and routes each request to one (`Router`): the replica whose earlier
prompts share the longest run of whole blocks with it, where its prefix cache may still hold them (a
conversation's next turn goes where its history is), unless that replica is busier than the least loaded by
more than `slack` requests; otherwise the least loaded. Its interface is EngineProcess's, so the Triton model
serves it unchanged (`start_engine`), and LLM drives it through add_request/step like an LLMEngine.
"""

from __future__ import annotations

import functools
import os
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from builder.engine import read_engine_config

from .distributed import STEP_TIMEOUT, _free_port
from .encoder_graphs import GraphedEncoder
from .engine_process import EngineProcess
from .programs import encode_media, program_on_device


def start_engine(engine_dir: str | os.PathLike, **kw: Any) -> EngineProcess | DataParallelEngine:
    """The engine a server talks to: one EngineProcess, or for an engine built with dp_size > 1 a
    DataParallelEngine (its replicas and their router, with the same interface)."""
    if read_engine_config(os.fspath(engine_dir)).get("mapping", {}).get("dp_size", 1) > 1:
        return DataParallelEngine(engine_dir, **kw)
    return EngineProcess(engine_dir, **kw)


class Router:
    """Picks each request's replica (module docstring): prefix affinity by whole blocks, within `slack`
    requests of the least loaded replica, else the least loaded (the lowest rank among equals). Each replica
    remembers the block prefixes of the last `capacity` blocks routed to it."""

    def __init__(self, num_replicas: int, block_size: int, slack: int = 4, capacity: int = 1 << 16):
        self.block_size, self.slack, self.capacity = block_size, slack, capacity
        self.load = [0] * num_replicas  # requests in flight
        self.seen: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]

    def prefix_keys(self, ids: list[int]) -> list[int]:
        """One key per whole block of `ids`: a hash of the prompt up to that block's end."""
        keys, h, bs = [], 0, self.block_size
        for end in range(bs, len(ids) + 1, bs):
            h = hash((h, tuple(ids[end - bs : end])))
            keys.append(h)
        return keys

    def matched(self, replica: int, keys: list[int]) -> int:
        """Whole blocks of the prompt the replica has seen, from the start."""
        n = 0
        for k in keys:
            if k not in self.seen[replica]:
                break
            n += 1
        return n

    def pick(self, ids: list[int]) -> int:
        """The replica for a prompt of token ids `ids`; it counts as one more request in flight there."""
        keys = self.prefix_keys(ids)
        least = min(range(len(self.load)), key=lambda r: (self.load[r], r))
        depth, best = max((self.matched(r, keys), -r) for r in range(len(self.load)))
        best = -best
        r = best if depth and self.load[best] <= self.load[least] + self.slack else least
        seen = self.seen[r]
        for k in keys:
            seen[k] = None
            seen.move_to_end(k)
        while len(seen) > self.capacity:
            seen.popitem(last=False)
        self.load[r] += 1
        return r

    def done(self, replica: int) -> None:
        self.load[replica] -= 1


def merge_stats(stats: list[dict]) -> dict:
    """The replicas' cache statistics as one engine's: counters summed; the expert load (`moe_*`) from the
    replica whose read is the latest (every replica counts every replica's rows: each computes the router
    for all of them), i.e. the one with the most routed choices."""
    out: dict[str, Any] = {}
    for s in stats:
        for k, v in s.items():
            if not k.startswith("moe_") and isinstance(v, (int, float)) and not isinstance(v, bool):
                out[k] = out.get(k, 0) + v
    latest = max(stats, key=lambda s: s.get("moe_routed_choices", 0), default={})
    out.update({k: v for k, v in latest.items() if k.startswith("moe_")})
    out["dp_size"] = len(stats)
    out["dp_running"] = [s.get("running", 0) for s in stats]
    return out


class DataParallelEngine:
    """The front of a data-parallel engine: its replicas (engine processes that join one another as the
    engine's ranks) and the router. EngineProcess's interface (submit, abort, cache_stats, shutdown) for
    servers; add_request, step, abort_request and has_unfinished for LLM."""

    def __init__(
        self,
        engine_dir: str | os.PathLike,
        seed: int = 0,
        num_threads: int = 0,
        on_exit: Callable[[str], Any] | None = None,
        **options: Any,
    ):
        """Start the replicas (each loads its rank of the engine; a load error is raised here) and wait for
        them all. seed: replica r samples unseeded requests from seed + r. on_exit(reason): called once if a
        replica exits without being told to; the others are stopped then (their steps would wait for it).
        options: each replica's EngineProcess options (num_blocks, cuda_graphs, overlap, pad_eager)."""
        engine_dir = os.fspath(engine_dir)
        config = read_engine_config(engine_dir)
        n = config["mapping"]["dp_size"]
        port = _free_port()
        self._store = dist.TCPStore(
            "127.0.0.1", port, n + 1, is_master=True, timeout=STEP_TIMEOUT, wait_for_workers=False
        )
        if not num_threads and config["device"] == "cpu":  # the replicas share the host's cores
            num_threads = max(1, (os.cpu_count() or 1) // n)
        self._lock = threading.Lock()
        self._where: dict[str, int] = {}  # request id -> its replica, while in flight
        self._on_exit, self._exited = on_exit, False
        self.replicas = []
        try:
            for r in range(n):
                self.replicas.append(
                    EngineProcess(
                        engine_dir,
                        seed=seed + r,
                        num_threads=num_threads,
                        on_exit=functools.partial(self._replica_exited, r),
                        dp=(r, f"127.0.0.1:{port}"),
                        wait=False,
                        **options,
                    )
                )
            for replica in self.replicas:
                replica.wait_ready()
        except BaseException:
            for replica in self.replicas:
                replica.kill()
            raise
        self.router = Router(n, config["build_config"]["tokens_per_block"])
        self._engine_dir, self._config, self._towers = engine_dir, config, None
        self._deltas: queue.Queue = queue.Queue()  # LLM's side: every request's deltas
        self._pending: list[tuple] = []  # LLM's side: requests added, sent at the next step

    # EngineProcess's interface.
    def submit(self, request_id: str, prompt, params, on_delta: Callable) -> None:
        """Route a request to a replica and queue it there."""
        self.submit_many([(request_id, prompt, params, on_delta)])

    def submit_many(self, requests: list[tuple]) -> None:
        """Route requests (request_id, prompt, params, on_delta) and queue each replica's share in one
        message (EngineProcess.submit_many)."""
        routed: dict[int, list[tuple]] = {}
        with self._lock:
            ids = [r[0] for r in requests]
            for i, rid in enumerate(ids):
                if rid in self._where or rid in ids[:i]:
                    raise ValueError(f"request id {rid!r} is already in flight")
            for rid, prompt, params, on_delta in requests:
                r = self.router.pick(prompt.input_ids.tolist())
                self._where[rid] = r
                routed.setdefault(r, []).append((rid, prompt, params, self._delivered(r, on_delta)))
        for r, share in routed.items():
            try:
                self.replicas[r].submit_many(share)
            except BaseException:
                with self._lock:
                    for rid, *_ in share:
                        self._where.pop(rid, None)
                        self.router.done(r)
                raise

    def _delivered(self, replica: int, on_delta: Callable) -> Callable:
        """on_delta, after a final delta releases its request's place in the router's load."""

        def delivered(d) -> None:
            if d.finish_reason is not None:
                with self._lock:
                    if self._where.pop(d.request_id, None) is not None:
                        self.router.done(replica)
            on_delta(d)

        return delivered

    def abort(self, request_id: str) -> None:
        with self._lock:
            r = self._where.get(request_id)
        if r is not None:
            self.replicas[r].abort(request_id)

    def cache_stats(self) -> dict:
        return merge_stats([replica.cache_stats() for replica in self.replicas])

    @property
    def alive(self) -> bool:
        return all(replica.alive for replica in self.replicas)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop every replica (they agree to stop together, their requests aborted)."""
        self._exited = True  # a replica's exit from here on is ours
        for replica in self.replicas:
            replica.request_stop()
        for replica in self.replicas:
            replica.shutdown(timeout)

    def _replica_exited(self, rank: int, reason: str) -> None:
        with self._lock:
            first, self._exited = not self._exited, True
        if not first:
            return
        for replica in self.replicas:  # the others would wait in their next step's collectives
            replica.kill()
        if self._on_exit is not None:
            self._on_exit(f"data-parallel replica {rank}: {reason}")

    @torch.no_grad()
    def encode_media(self, pixel_values: list[torch.Tensor], levels: list[torch.Tensor]) -> torch.Tensor:
        """A prompt's media embeddings (ModelRunner.encode_media), for LLM: the front loads the towers'
        programs (rank 0's, their weights inside: small beside the engine) at the first media prompt, and
        the replicas take the embeddings as any engine does."""
        if self._towers is None:
            config = self._config
            device = torch.device(config["device"])
            if device.type == "cuda":
                device = torch.device("cuda", torch.cuda.current_device())
            dtype = getattr(torch, config["dtype"])
            towers = {}
            for name in ("vision", "audio"):
                path = os.path.join(self._engine_dir, f"rank0.{name}.pt2")
                if os.path.exists(path):
                    program = program_on_device(torch.export.load(path), device).module()
                    towers[name] = GraphedEncoder(program, name, device, dtype, engine_config=config)
            hidden = config["pretrained_config"]["text_config"]["hidden_size"]
            self._towers = (towers.get("vision"), towers.get("audio"), device, dtype, hidden)
        vision, audio, device, dtype, hidden = self._towers
        return encode_media(vision, audio, pixel_values, levels, device, dtype, hidden)

    # LLM's interface (an LLMEngine's, as LLM.generate uses it): requests added between two steps go out
    # together at the next `step`, as they reach an engine in the same process together.
    def add_request(self, request_id: str, prompt, params) -> None:
        with self._lock:
            if request_id in self._where or any(p[0] == request_id for p in self._pending):
                raise ValueError(f"request id {request_id!r} is already in flight")
        self._pending.append((request_id, prompt, params, self._deltas.put))

    def abort_request(self, request_id: str) -> None:
        """Abort; its final delta comes with a later `step` (one not sent yet is dropped)."""
        self._pending = [p for p in self._pending if p[0] != request_id]
        self.abort(request_id)

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._where or self._pending)

    def step(self, timeout: float = 1.0) -> list:
        """Send the requests added since the last step, then the deltas that have come from the replicas:
        waits up to `timeout` seconds for the first."""
        if self._pending:
            pending, self._pending = self._pending, []
            self.submit_many(pending)
        out = []
        try:
            out.append(self._deltas.get(timeout=timeout))
            while True:
                out.append(self._deltas.get_nowait())
        except queue.Empty:
            pass
        if not out and not self.alive:
            raise RuntimeError("a data-parallel replica has exited")
        return out
