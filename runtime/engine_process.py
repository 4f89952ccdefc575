"""EngineProcess: the engine loop in a process of its own, for servers.

EngineLoop steps the engine on a thread of its caller's process, so whatever else that process does in
Python (a Triton stub building and sending a response per token) waits for the same GIL as the engine's
scheduling, sampling and detokenizing. EngineProcess runs the LLMEngine in a child process instead,
`python -m runtime.engine_child` (runtime/engine_child.py), and talks to it over a socket pair:

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

import os
import pickle
import socket
import subprocess
import threading
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from .distributed import PROJECT_ROOT, python_executable
from .engine import PromptInput, StreamDelta
from .params import SamplingParams

SWITCH = {None: "auto", True: "1", False: "0"}
Callback = Callable[[StreamDelta], Any]


class EngineGone(RuntimeError):
    """The engine process has exited: this EngineProcess takes no more requests (start another)."""


def child_argv(
    engine_dir: str | os.PathLike,
    fd: int,
    num_blocks: int | None = None,
    seed: int = 0,
    num_threads: int = 0,
    cuda_graphs: bool | None = None,
    overlap: bool | None = None,
    dp: tuple[int, str] | None = None,
    pad_eager: bool = False,
    max_prefill_pairs: int | None = None,
    decode_slowdown: float | None = None,
) -> list[str]:
    """`python -m runtime.engine_child`'s arguments for EngineProcess's options (runtime.engine_child
    parse_args reads them back)."""
    args = ["--engine_dir", os.path.abspath(engine_dir), "--fd", str(fd)]
    args += ["--num_blocks", str(num_blocks or 0), "--seed", str(seed), "--num_threads", str(num_threads)]
    args += ["--cuda_graphs", SWITCH[cuda_graphs], "--overlap", SWITCH[overlap]]
    args += [
        "--max_prefill_pairs",
        str(max_prefill_pairs or 0),
        "--decode_slowdown",
        str(decode_slowdown or 0),
    ]
    if dp is not None:
        args += ["--dp_rank", str(dp[0]), "--dp_store", dp[1]]
    if pad_eager:
        args.append("--pad_eager")
    return args


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
        pad_eager: bool = False,
        max_prefill_pairs: int | None = None,
        decode_slowdown: float | None = None,
    ):
        """Start the child and wait until its engine is loaded (a load error is raised here, with the
        child's traceback). num_threads: the child's torch threads (0: torch's default). on_exit(reason):
        called on the reader thread if the child exits without being told to (after the requests in
        flight got their error deltas), e.g. to start another. dp: (rank, store address) of a data-parallel
        replica (runtime/data_parallel.py). wait False: return at once; `wait_ready` waits (the replicas of
        a data-parallel engine load together, each waiting for the others to join). pad_eager (tests),
        max_prefill_pairs, decode_slowdown: LLM's."""
        ours, theirs = socket.socketpair()
        args = child_argv(
            engine_dir, theirs.fileno(), num_blocks=num_blocks, seed=seed, num_threads=num_threads,
            cuda_graphs=cuda_graphs, overlap=overlap, dp=dp, pad_eager=pad_eager,
            max_prefill_pairs=max_prefill_pairs, decode_slowdown=decode_slowdown,
        )  # fmt: skip
        path = os.pathsep.join(filter(None, [PROJECT_ROOT, os.environ.get("PYTHONPATH")]))
        with theirs:
            self.proc = subprocess.Popen(
                [python_executable(), "-m", "runtime.engine_child", *args],
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
        self.submit_many([(request_id, prompt, params, on_delta)])

    def submit_many(self, requests: list[tuple[str, PromptInput, SamplingParams, Callback]]) -> None:
        """Queue requests (request_id, prompt, params, on_delta) in one message: the child admits them
        between the same two steps, as an engine in this process would admit requests added together."""
        ids = [r[0] for r in requests]
        with self._lock:
            if self._dead is not None:
                raise EngineGone(f"the engine process is gone: {self._dead}")
            for i, rid in enumerate(ids):
                if rid in self._callbacks or rid in ids[:i]:
                    raise ValueError(f"request id {rid!r} is already in flight")
            self._callbacks.update((rid, on_delta) for rid, _, _, on_delta in requests)
        try:
            self._send(("add", [(rid, prompt, params) for rid, prompt, params, _ in requests]))
        except BaseException as e:
            with self._lock:
                for rid in ids:
                    self._callbacks.pop(rid, None)
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
