"""The runtime's host work per decode step and per MTP round, apart from the programs it runs.

    python -m bench.host --engine build/engine-tiny --out DIR [--batch 1 8] [--drafts 0 3] [--steps 40]

On the GPU a step's kernels are CUDA-graph replays; what the host does around them (building a step's
inputs from the scheduled sequences, padding them into a bucket's buffers, the MTP heads' inputs, the draft
picks, sampling, the scheduler) is what a step waits for whenever the host is on its critical path: every
MTP round (drafting waits for the verify's tokens) and every step of a sequence that is not overlapped.

This bench runs the engine's own step loop (greedy requests, or sampled with --temperature; `num_draft_tokens` drafts every step: the
adaptive policy off) and times, per engine step, the host's wall time in
- `ModelRunner.run` (the main step), without the step program's own call;
- `ModelRunner.run_heads` (the MTP round), without the head program's calls and the draft picks;
- the rest of `LLMEngine.step` (scheduler, sampling, acceptance, deltas).
It also counts the torch operators dispatched outside the programs (each one a kernel launch or a copy on
the GPU). On the CPU the engine pads decode steps to the CUDA-graph buckets and runs them eagerly
(`pad_eager`), so the staging is the GPU's, and a program called again with inputs of the same shapes
returns its first call's outputs (`--no-replay` runs every call; see `measure` for why). On the GPU (a
CUDA engine) the step and head passes are graph replays, launched without waiting; the figures then also
hold the waits for the device where the host reads results (an MTP round's drafts, the verified tokens),
which a tiny engine's short kernels keep small.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from builder import Engine
from runtime import LLMEngine, PromptInput, SamplingParams


class Clock:
    """Wall time by label: the components (`run`, `run_heads`) and the programs called inside each
    (`program@run`, ...); operators are not counted inside programs."""

    def __init__(self, replay: bool = False):
        self.seconds: dict[str, float] = {}
        self.where = "step"
        self.counter: OpCounter | None = None
        # replay: a program called again with arguments of the same shapes returns its first call's
        # outputs without running (see `measure`).
        self.replay = replay
        self.recorded: dict[tuple, object] = {}

    def _add(self, label: str, seconds: float) -> None:
        self.seconds[label] = self.seconds.get(label, 0.0) + seconds

    def program(self, fn):
        def timed(*args, **kwargs):
            # Programs run outside the counting mode (it would also meet their custom ops' rules).
            outside = _disable_current_modes() if self.counter is not None else contextlib.nullcontext()
            start = time.perf_counter()
            try:
                with outside:
                    if not self.replay:
                        return fn(*args, **kwargs)
                    key = (id(fn), *_shapes(args))
                    if key not in self.recorded:
                        self.recorded[key] = fn(*args, **kwargs)
                    return self.recorded[key]
            finally:
                self._add(f"program@{self.where}", time.perf_counter() - start)

        return timed

    def component(self, label: str, fn):
        def timed(*args, **kwargs):
            before, self.where = self.where, label
            if self.counter is not None:
                self.counter.where = label
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._add(label, time.perf_counter() - start)
                self.where = before
                if self.counter is not None:
                    self.counter.where = before

        return timed


# Operators that only make tensor metadata or allocate (no kernel on the GPU), and those that read a
# value back to the host (on the GPU a wait for the device).
METADATA_OPS = {
    "alias", "as_strided", "detach", "empty", "expand", "lift_fresh", "permute", "_reshape_alias", "reshape",
    "select", "slice", "split", "split_with_sizes", "squeeze", "t", "transpose", "unbind", "unsqueeze", "view",
}  # fmt: skip
READBACK_OPS = {"_local_scalar_dense"}


class OpCounter(TorchDispatchMode):
    """Counts the aten operators dispatched outside the programs, by component and kind: "kernel" (a
    launch or copy on the GPU), "metadata" (views, allocation) and "readback" (.item())."""

    def __init__(self):
        super().__init__()
        self.where = "step"
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__.removesuffix("_")
        kind = "metadata" if name in METADATA_OPS else "readback" if name in READBACK_OPS else "kernel"
        key = f"{self.where}:{kind}"
        self.counts[key] = self.counts.get(key, 0) + 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def instrumented(engine: LLMEngine, clock: Clock):
    """Time the runner's programs, the draft pick and the two host components in `clock`."""
    runner = engine.runner
    saved = []

    def patch(obj, name, new):
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, new)

    for graphs in (runner.step_graphs, runner.head_graphs, runner.draft_graphs):
        if graphs is not None:
            patch(graphs, "program", clock.program(graphs.program))
    patch(runner, "step", clock.program(runner.step))
    if runner.head is not None:
        patch(runner, "head", clock.program(runner.head))
    for name in ("run", "run_heads"):
        patch(runner, name, clock.component(name, getattr(runner, name)))
    try:
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


def _shapes(args) -> list:
    """The shapes (and for int8 q bounds and scalars, the values) that tell a program's calls apart."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append((tuple(a.shape), a.dtype))
        elif isinstance(a, (list, tuple)):
            out.append(tuple(_shapes(a)))
        elif isinstance(a, dict):
            out.append(id(a))
        else:
            out.append(a)
    return out


def measure(
    engine: LLMEngine,
    batch: int,
    drafts: int,
    steps: int,
    prompt_len: int,
    count_ops: bool,
    replay: bool,
    temperature: float = 0.0,
) -> dict:
    """Median host milliseconds per engine step in `run` and `run_heads` (each without the programs it
    calls) and in the rest of the step; with count_ops, the operators per step outside the programs.

    replay: the programs and draft picks return, after their first call of a shape, that call's outputs
    without running, as a CUDA-graph replay costs the host nothing. Without it, on the CPU, the host
    work runs between programs that flush the host's caches, which a GPU's programs do not, and its
    time comes out several times its warm cost (on this 2-core machine, a 2 µs NumPy call took 10-30 µs
    there). The tokens are then meaningless, the host's path through a step is the same."""
    vocab = engine.config.vocab_size
    params = SamplingParams(
        max_tokens=steps * (drafts + 1) + 16,
        num_draft_tokens=drafts,
        ignore_eos=True,
        temperature=temperature,
    )
    for b in range(batch):
        ids = torch.tensor([(7 * b + 3 * i) % (vocab - 16) + 8 for i in range(prompt_len)])
        engine.add_request(f"host-{batch}-{drafts}-{b}", PromptInput(ids), params)
    states = list(engine.requests.values())
    while not all(s.seq.output_ids for s in states):  # prefill
        engine.step()
    engine.step()  # one decode (or MTP) step: the buckets are made
    clock = Clock(replay)
    counter = clock.counter = OpCounter() if count_ops else None
    rows = []
    with instrumented(engine, clock):
        for _ in range(steps):
            clock.seconds.clear()
            start = time.perf_counter()
            if counter is not None:
                with counter:
                    engine.step()
            else:
                engine.step()
            total = time.perf_counter() - start
            s = clock.seconds
            run = s.get("run", 0.0) - s.get("program@run", 0.0)
            heads = s.get("run_heads", 0.0) - s.get("program@run_heads", 0.0)
            rest = total - s.get("run", 0.0) - s.get("run_heads", 0.0) - s.get("program@step", 0.0)
            rows.append((run, heads, rest))
    for rid in list(engine.requests):
        engine.abort_request(rid)
    out = {"batch": batch, "drafts": drafts, "steps": steps}
    for j, name in enumerate(("run", "run_heads", "rest")):
        out[f"host_ms_{name}"] = round(1e3 * statistics.median(r[j] for r in rows), 3)
    if counter is not None:
        out["ops_per_step"] = {k: v / steps for k, v in sorted(counter.counts.items())}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True, help="engine directory (python -m builder)")
    ap.add_argument("--out", required=True, help="directory for host.json and host.md")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--drafts", type=int, nargs="+", default=[0, 3])
    ap.add_argument("--steps", type=int, default=30, help="timed engine steps per case")
    ap.add_argument("--prompt_len", type=int, default=24)
    ap.add_argument(
        "--temperature", type=float, default=0.0, help="0: greedy; else sampled, a seed a request"
    )
    ap.add_argument(
        "--no-replay",
        dest="replay",
        action="store_false",
        help="run every program call (see `measure`): host times then include the host's cold caches",
    )
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    engine = Engine.from_dir(args.engine)
    on_cuda = engine.config["build_config"]["device"] == "cuda"
    replay = args.replay and not on_cuda  # on the GPU the programs are graph replays already
    results = []
    llm = LLMEngine(engine, pad_eager=not on_cuda, overlap=False)
    llm.spec.fix_drafts()  # synthetic heads accept nothing: the adaptive policy would stop
    for batch in args.batch:
        for drafts in args.drafts:
            row = measure(llm, batch, drafts, args.steps, args.prompt_len, False, replay, args.temperature)
            row["ops_per_step"] = measure(
                llm, batch, drafts, 4, args.prompt_len, True, replay, args.temperature
            )["ops_per_step"]
            results.append(row)
            print(json.dumps(row), file=sys.stderr)
    with open(os.path.join(args.out, "host.json"), "w") as f:
        json.dump(
            {"engine": args.engine, "device": "cuda" if on_cuda else "cpu", "results": results}, f, indent=1
        )
    lines = [
        f"# Host work per engine step (`python -m bench.host --engine {args.engine}`), "
        + ("greedy" if not args.temperature else f"sampled at temperature {args.temperature:g}"),
        "",
        "Host milliseconds per engine step (median) and torch operators per step outside the programs, as",
        "kernel launches or copies / metadata-only (views, allocations) / reads back to the host.",
        "",
        "| batch | drafts | run (ms) | run_heads (ms) | rest (ms) | ops: run | ops: run_heads | ops: rest |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ops = r["ops_per_step"]

        def kinds(where: str, ops: dict = ops) -> str:
            return " / ".join(f"{ops.get(f'{where}:{k}', 0):.0f}" for k in ("kernel", "metadata", "readback"))

        lines.append(
            f"| {r['batch']} | {r['drafts']} | {r['host_ms_run']} | {r['host_ms_run_heads']} | {r['host_ms_rest']} "
            f"| {kinds('run')} | {kinds('run_heads')} | {kinds('step')} |"
        )
    with open(os.path.join(args.out, "host.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
