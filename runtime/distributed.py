"""Tensor-parallel ranks for the runtime: rank 0 is the LLM's own process, the others are worker processes
that it starts (DESIGN.md "Tensor parallelism", docs/interfaces.md "Tensor parallelism").

Rank 0 schedules, samples, encodes media and runs the MTP heads. Every call of its ModelRunner that
touches what each rank holds (the step over its KV and sconv slices, a slot's reset, prefix-cache
snapshots, rollback) is first broadcast to the workers, which make the same call on their own
ModelRunner: the step's inputs go out every step, and the ranks' collectives inside the step program
meet. Two process groups: the default one (gloo on CPU, NCCL on CUDA) carries the step's collectives
through the communicator (plugins.collectives); a gloo group carries the control messages, with a long
timeout since a worker waits there for as long as the server is idle.

The workers are `python -m runtime.worker` processes (runtime/worker.py).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from builder.engine import world_size_of
from plugins.collectives import init_communicator, set_communicator

CONTROL_TIMEOUT = timedelta(days=365)  # a worker waits for the next call as long as the server idles
STEP_TIMEOUT = timedelta(minutes=10)  # a collective inside a step (a rank that died shows up here)
CONTROL_BYTES = 1 << 16  # a control message's one broadcast: an 8-byte length, then the pickled call
PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass
class RankGroup:
    """This process's place among the ranks: the control group and the step collectives' communicator."""

    rank: int
    world_size: int
    control: dist.ProcessGroup
    buffer: torch.Tensor = dataclasses.field(
        default_factory=lambda: torch.zeros(CONTROL_BYTES, dtype=torch.uint8)
    )

    @classmethod
    def join(cls, store: dist.Store, rank: int, world_size: int, device: str, collectives: str) -> RankGroup:
        """Every rank calls this at start: process groups, then the communicator the step's ops use.
        collectives: the engine's impl of the collective ops ("triton" on CUDA: the Lamport communicator)."""
        cuda = device == "cuda"
        if cuda:
            torch.cuda.set_device(rank)
        backend = "nccl" if cuda else "gloo"
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=STEP_TIMEOUT)
        control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        backend = ("lamport" if collectives == "triton" else "nccl") if cuda else "gloo"
        dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
        set_communicator(init_communicator(backend, rank=rank, world_size=world_size, device=dev))
        return cls(rank, world_size, control)

    def send_call(self, method: str, args: tuple, reply: bool) -> None:
        """Rank 0: broadcast a call to the workers, as one fixed-size broadcast of its pickle (its tensors as
        WireTensors), and a second one where it does not fit. broadcast_object_list costs more: it sends
        the size, then the object, each with its own conversions."""
        payload = pickle.dumps((method, to_wire(args), reply), protocol=pickle.HIGHEST_PROTOCOL)
        view = self.buffer.numpy()
        view[:8].view(np.int64)[0] = len(payload)
        fits = len(payload) <= CONTROL_BYTES - 8
        if fits:
            view[8 : 8 + len(payload)] = np.frombuffer(payload, dtype=np.uint8)
        dist.broadcast(self.buffer, src=0, group=self.control)
        if not fits:
            dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0, group=self.control)

    def receive_call(self) -> tuple[str, tuple, bool]:
        """A worker: the next call rank 0 sends (send_call), its tensors on the host."""
        dist.broadcast(self.buffer, src=0, group=self.control)
        view = self.buffer.numpy()
        n = int(view[:8].view(np.int64)[0])
        if n <= CONTROL_BYTES - 8:
            payload = view[8 : 8 + n].tobytes()
        else:
            big = torch.empty(n, dtype=torch.uint8)
            dist.broadcast(big, src=0, group=self.control)
            payload = big.numpy().tobytes()
        method, args, reply = pickle.loads(payload)
        return method, from_wire(args), reply

    def leave(self) -> None:
        from plugins.collectives import get_communicator

        get_communicator().close()
        set_communicator(None)
        dist.destroy_process_group()


class WireTensor:
    """A host tensor as the control group sends it: its bytes as a numpy array (numpy arrays pickle as
    one raw buffer; a torch tensor's own pickle costs ~6x more, and the control group carries a step's
    inputs every step), its dtype and shape."""

    __slots__ = ("data", "dtype", "shape")

    def __init__(self, t: torch.Tensor):
        t = t.detach().cpu().contiguous()
        self.data = t.reshape(-1).view(torch.uint8).numpy()
        self.dtype, self.shape = t.dtype, tuple(t.shape)

    def __getstate__(self):
        return self.data, self.dtype, self.shape

    def __setstate__(self, state):
        self.data, self.dtype, self.shape = state

    def tensor(self) -> torch.Tensor:
        return torch.from_numpy(self.data).view(self.dtype).reshape(self.shape)


def to_wire(obj: Any) -> Any:
    """`obj` with its tensors (also inside tuples, lists, dicts and dataclasses) as WireTensors."""
    return _map_tensors(obj, WireTensor)


def from_wire(obj: Any) -> Any:
    """The inverse of to_wire: host tensors again."""
    return _map_tensors(obj, WireTensor.tensor)


def _map_tensors(obj: Any, fn: Callable[[Any], Any]) -> Any:
    if isinstance(obj, (torch.Tensor, WireTensor)):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(x, fn) for x in obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(
            obj, **{f.name: _map_tensors(getattr(obj, f.name), fn) for f in dataclasses.fields(obj)}
        )
    return obj


class Workers:
    """Rank 0's side: the N-1 worker processes, and the calls it broadcasts to them."""

    def __init__(self, engine_dir: str, config: dict, num_blocks: int | None = None, graphs: str = "off"):
        """Start the workers of the engine at `engine_dir` (its config.json `config`) and join them as rank 0.
        graphs: "cuda", "pad_eager" or "off", as rank 0's runner has them (every rank pads alike, so the
        step's collectives meet with the same shapes)."""
        if dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is already initialised in this process: one tensor-parallel LLM per "
                "process at a time (shut the other down first)"
            )
        self.world_size = world_size_of(config)
        device = config["device"]
        collectives = config["plugin_config"]["impls"].get("collectives", "reference")
        port = _free_port()
        store = dist.TCPStore(
            "127.0.0.1", port, self.world_size, is_master=True, timeout=STEP_TIMEOUT, wait_for_workers=False
        )
        path = os.pathsep.join(filter(None, [PROJECT_ROOT, os.environ.get("PYTHONPATH")]))
        args = ["--engine_dir", os.path.abspath(engine_dir), "--world_size", str(self.world_size)]
        args += ["--store", f"127.0.0.1:{port}", "--num_blocks", str(num_blocks or 0), "--graphs", graphs]
        self.procs = [
            subprocess.Popen(
                [python_executable(), "-m", "runtime.worker", *args, "--rank", str(rank)],
                env={**os.environ, "PYTHONPATH": path},
            )
            for rank in range(1, self.world_size)
        ]
        try:
            self._wait_started(store)
            self.group = RankGroup.join(store, 0, self.world_size, device, collectives)
        except BaseException:
            self._kill()
            raise
        self.closed = False

    def _wait_started(self, store: dist.Store) -> None:
        """Until every worker has started (imports done, `started/{rank}` set in the store); a worker that
        exits first is an error here rather than a join that waits for it until the timeout."""
        keys = [f"started/{rank}" for rank in range(1, self.world_size)]
        while not store.check(keys):
            for rank, proc in enumerate(self.procs, start=1):
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"tensor-parallel worker rank {rank} exited with code {proc.returncode} while starting"
                    )
            time.sleep(0.05)

    def call(self, method: str, *args: Any) -> None:
        """Every worker runs `runner.<method>(*args)` on its own ModelRunner (rank 0 runs it itself)."""
        self._send(method, args, reply=False)

    def gather(self, method: str, *args: Any, own: Any = None) -> list[Any]:
        """Like `call`, and collect each rank's result: [own (rank 0's), rank 1's, ...]."""
        self._send(method, args, reply=True)
        out = [None] * self.world_size
        dist.gather_object(own, out, dst=0, group=self.group.control)
        return out

    def _send(self, method: str, args: tuple, reply: bool) -> None:
        if self.closed:
            raise RuntimeError("the tensor-parallel workers were shut down")
        for rank, proc in enumerate(self.procs, start=1):
            if proc.poll() is not None:
                raise RuntimeError(f"tensor-parallel worker rank {rank} exited with code {proc.returncode}")
        self.group.send_call(method, args, reply)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the workers and leave the process groups (the process can then start others)."""
        if self.closed:
            return
        left = False
        try:
            if all(p.poll() is None for p in self.procs):
                self.group.send_call("shutdown", (), False)
                # Leave with the workers, not after them: NCCL's teardown may wait for every rank. (On
                # 2xH200 rank 0 waited its full timeout for a worker to exit, then killed it.)
                left = True
                self.group.leave()
            deadline = time.monotonic() + timeout
            for proc in self.procs:
                proc.wait(max(0.1, deadline - time.monotonic()))
        except Exception:
            self._kill()
        finally:
            self.closed = True
            if not left:
                self.group.leave()

    def _kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def python_executable() -> str:
    """A Python interpreter for child processes (tensor-parallel workers, the engine process): this one, unless it is embedded (Triton's Python-backend
    stub), where the `python3` first on PATH is the stubs' environment."""
    if os.path.basename(sys.executable).startswith("python"):
        return sys.executable
    found = shutil.which("python3")
    if found is None:
        raise RuntimeError(f"no Python interpreter to start child processes ({sys.executable} is embedded)")
    return found
