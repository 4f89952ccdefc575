"""EngineProcess: the engine loop in a process of its own, for servers.

EngineLoop steps the engine on a thread of its caller's process, so whatever else that process does in
Python (a Triton stub building and sending a response per token) waits for the same GIL as the engine's
scheduling, sampling and detokenizing. EngineProcess runs the LLMEngine in a child process instead,
`python -m runtime.engine_process`, and talks to it over a socket pair:

    parent (the server)                      child (the engine)
    submit, abort, shutdown      ───────►    read between steps: add_request, abort_request
    on_delta callbacks           ◄───────    after each step: its deltas and the cache statistics

The child never waits for the parent while it has work: it polls for messages between steps and sends
each step's deltas as one message. The parent's reader thread hands them to the callbacks.

The interface is EngineLoop's (submit, abort, cache_stats, shutdown), with one difference: a request
the engine refuses (too long, out-of-range ids, ...) is refused in the child, so `submit` does not
raise; the request's one delta has finish_reason "rejected" and the reason in `error`. If the child
dies, each request in flight gets a delta with finish_reason "error", later submits raise EngineGone,
and `on_exit` is called (the Triton model starts another EngineProcess there).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pickle
import socket
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch

from .data_parallel import IDLE_POLL_S
from .distributed import PROJECT_ROOT, python_executable
from .engine import PromptInput, StreamDelta
from .params import SamplingParams

SWITCH = {None: "auto", True: "1", False: "0"}
Callback = Callable[[StreamDelta], Any]


class EngineGone(RuntimeError):
    """The engine process has exited: this EngineProcess takes no more requests (start another)."""


class EngineProcess:
    """The engine at `engine_dir`, stepping in a child process; requests come and go from any thread.

    on_delta callbacks run on this process's reader thread: keep them short (e.g. hand off to a queue)."""

    def __init__(
        self,
        engine_dir: str | os.PathLike,
        num_blocks: int | None = None,
        seed: int = 0,
        cuda_graphs: bool | None = None,
        overlap: bool | None = None,
        num_threads: int = 0,
        on_exit: Callable[[str], Any] | None = None,
        dp: tuple[int, str] | None = None,
        wait: bool = True,
    ):
        """Start the child and wait until its engine is loaded (a load error is raised here, with the
        child's traceback). num_threads: the child's torch threads (0: torch's default). on_exit(reason):
        called on the reader thread if the child exits without being told to (after the requests in
        flight got their error deltas), e.g. to start another. dp: (rank, store address) of a data-parallel
        replica (runtime/data_parallel.py). wait False: return at once; `wait_ready` waits (the replicas of
        a data-parallel engine load together, each waiting for the others to join)."""
        ours, theirs = socket.socketpair()
        args = ["--engine_dir", os.path.abspath(engine_dir), "--fd", str(theirs.fileno())]
        args += ["--num_blocks", str(num_blocks or 0), "--seed", str(seed), "--num_threads", str(num_threads)]
        args += ["--cuda_graphs", SWITCH[cuda_graphs], "--overlap", SWITCH[overlap]]
        if dp is not None:
            args += ["--dp_rank", str(dp[0]), "--dp_store", dp[1]]
        path = os.pathsep.join(filter(None, [PROJECT_ROOT, os.environ.get("PYTHONPATH")]))
        with theirs:
            self.proc = subprocess.Popen(
                [python_executable(), "-m", "runtime.engine_process", *args],
                pass_fds=[theirs.fileno()],
                env={**os.environ, "PYTHONPATH": path},
            )
        self.engine_dir = engine_dir
        self._conn = Connection(ours.detach())
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # the callbacks, the statistics, `_dead`
        self._callbacks: dict[str, Callback] = {}
        self._dead: str | None = None  # why the child is gone
        self._stopping = False
        self._on_exit = on_exit
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Wait until the child has loaded its engine; raise its load error."""
        try:
            kind, *info = self._recv()
        except EOFError:
            kind, info = "failed", [f"it exited with code {self.proc.wait()} before loading the engine"]
        if kind != "ready":
            self.kill()
            self._conn.close()
            raise RuntimeError(f"the engine process could not load {self.engine_dir}: {info[0]}")
        self._stats: dict = info[0]
        self._reader = threading.Thread(target=self._read, name="inkling-engine-reader", daemon=True)
        self._reader.start()

    def kill(self) -> None:
        """End the child at once (its requests in flight get error deltas from the reader)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    # Requests.
    def submit(
        self, request_id: str, prompt: PromptInput, params: SamplingParams, on_delta: Callback
    ) -> None:
        """Queue a request (token ids and media embeddings; text is prepared by the caller)."""
        with self._lock:
            if self._dead is not None:
                raise EngineGone(f"the engine process is gone: {self._dead}")
            if request_id in self._callbacks:
                raise ValueError(f"request id {request_id!r} is already in flight")
            self._callbacks[request_id] = on_delta
        try:
            self._send(("add", request_id, prompt, params))
        except BaseException as e:
            with self._lock:
                self._callbacks.pop(request_id, None)
            if isinstance(e, OSError):  # the child has died, and the reader has not seen it yet
                raise EngineGone(f"the engine process is gone: {e}") from e
            raise

    def abort(self, request_id: str) -> None:
        """Cancel a request: the child frees its blocks at once; its final delta has finish_reason "abort"."""
        try:
            self._send(("abort", request_id))
        except OSError:
            pass  # the child is gone: its requests have been ended already

    def cache_stats(self) -> dict:
        """The engine's cache statistics as of its last step or message."""
        with self._lock:
            return dict(self._stats)

    def request_stop(self) -> None:
        """Tell the child to stop (its requests are aborted), without waiting (`shutdown` waits)."""
        if self._stopping:
            return
        self._stopping = True
        try:
            self._send(("stop",))
        except OSError:
            pass

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the child (its requests are aborted) and wait for it; kill it after `timeout` seconds."""
        self.request_stop()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout)
        self._conn.close()

    # The wire: pickles, one message per send.
    def _send(self, message: tuple) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            self._conn.send_bytes(data)

    def _recv(self) -> tuple:
        return pickle.loads(self._conn.recv_bytes())

    def _read(self) -> None:
        while True:
            try:
                kind, deltas, stats = self._recv()
            except (EOFError, OSError):
                break
            with self._lock:
                self._stats = stats
                calls = [(d, self._callback_for(d)) for d in deltas]
            self._deliver(calls)
            if kind == "stopped":
                break
        code = self.proc.wait()
        with self._lock:
            self._dead = self._dead or f"it exited with code {code}"
            orphans, self._callbacks = self._callbacks, {}
        self._deliver(
            [(StreamDelta(rid, "", [], "error", 0, 0, error=f"the engine process exited (code {code})"), cb)
             for rid, cb in orphans.items()]
        )  # fmt: skip
        if not self._stopping and self._on_exit is not None:
            try:
                self._on_exit(self._dead)
            except Exception:  # noqa: BLE001
                traceback.print_exc()

    def _callback_for(self, d: StreamDelta) -> Callback | None:
        """The callback of d's request; a final delta's request is forgotten (call with the lock held)."""
        if d.finish_reason is not None:
            return self._callbacks.pop(d.request_id, None)
        return self._callbacks.get(d.request_id)

    @property
    def alive(self) -> bool:
        with self._lock:
            return self._dead is None

    @staticmethod
    def _deliver(calls: list[tuple[StreamDelta, Callback | None]]) -> None:
        for d, cb in calls:
            if cb is None:
                continue
            try:
                cb(d)
            except Exception:  # a broken callback must not stop the reader
                traceback.print_exc()


def start_engine(engine_dir: str | os.PathLike, **kw: Any) -> Any:
    """The engine a server talks to: one EngineProcess, or for an engine built with dp_size > 1 a
    DataParallelEngine (its replicas and their router, with the same interface)."""
    from builder.engine import read_engine_config

    from .data_parallel import DataParallelEngine

    if read_engine_config(os.fspath(engine_dir)).get("mapping", {}).get("dp_size", 1) > 1:
        return DataParallelEngine(engine_dir, **kw)
    return EngineProcess(engine_dir, **kw)


# The child.
def serve(conn: Connection, llm_args: dict) -> None:
    """Load the engine, say "ready", then step it, reading the parent's messages between steps, until
    "stop" or the parent is gone."""
    from .llm import LLM  # the child alone loads the engine

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
    """An "add" or "abort" from the parent: the deltas it ends with at once (a rejection, an abort)."""
    kind, rid, *rest = message
    delta = engine.abort_request(rid) if kind == "abort" else engine.try_add_request(rid, *rest)
    return [] if delta is None else [delta]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m runtime.engine_process", description=__doc__.split("\n\n")[0])
    p.add_argument("--engine_dir", required=True)
    p.add_argument("--fd", type=int, required=True, help="this end of the parent's socket pair")
    p.add_argument("--num_blocks", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num_threads", type=int, default=0)
    p.add_argument("--cuda_graphs", choices=list(SWITCH.values()), default="auto")
    p.add_argument("--overlap", choices=list(SWITCH.values()), default="auto")
    p.add_argument("--dp_rank", type=int, default=None, help="a data-parallel replica's rank")
    p.add_argument("--dp_store", default=None, help="the replicas' rendezvous store, HOST:PORT")
    args = p.parse_args(argv)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    switch = {v: k for k, v in SWITCH.items()}
    llm_args = dict(
        engine=args.engine_dir,
        num_blocks=args.num_blocks or None,
        seed=args.seed,
        cuda_graphs=switch[args.cuda_graphs],
        overlap=switch[args.overlap],
        dp=None if args.dp_rank is None else (args.dp_rank, args.dp_store),
    )
    serve(Connection(args.fd), llm_args)


if __name__ == "__main__":
    sys.exit(main())
