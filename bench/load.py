"""Engine load time in fresh processes: eager, and torch.compile with and without the build's cache artifacts.

    python -m bench.load --engine build/engine-compiled --out DIR            # an engine built with --compile
    python -m bench.load --engine build/engine-tiny --modes eager --out DIR    # eager only

Each run is a new Python process with empty Inductor and Triton cache directories (cold), except
`eager-warm`, which reuses the Triton cache of the `eager` run before it (Triton's own disk cache, as a
second start on one machine has it). A run times: the imports, `Engine.from_dir`, `LLMEngine` (weights
to the device, the programs), the first generate (2 prompts, 3 tokens: compiles everything a first
request needs) and a second, warm generate; and counts Inductor's FX graph cache hits and misses.
`compile-cold` loads the engine with its cache artifacts dropped; `compile-cached` with them
(`torch.compiler.load_cache_artifacts`, runtime/programs.py). Every mode gives the same tokens; the table
says so. A figure, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

MODES = ("eager", "eager-warm", "compile-cold", "compile-cached")


def child(engine_dir: str, mode: str) -> dict:
    """One load, in this (fresh) process."""
    t0 = time.perf_counter()
    import torch
    from torch._dynamo.utils import counters

    from builder import Engine
    from runtime import LLMEngine, PromptInput, SamplingParams

    out = {"mode": mode, "imports_s": time.perf_counter() - t0}
    t = time.perf_counter()
    engine = Engine.from_dir(engine_dir)
    out["from_dir_s"] = time.perf_counter() - t
    compile = mode.startswith("compile")
    if mode == "compile-cold":
        engine.compile_cache = None
    t = time.perf_counter()
    eng = LLMEngine(engine, cuda_graphs=False, overlap=False, compile=compile)
    out["runner_s"] = time.perf_counter() - t
    prompts = [torch.arange(1, 20), torch.arange(1, 7)]
    calls = iter(range(10))

    def generate():
        t, n = time.perf_counter(), next(calls)
        for i, ids in enumerate(prompts):
            eng.add_request(f"{n}-{i}", PromptInput(ids), SamplingParams(max_tokens=3, ignore_eos=True))
        tokens: dict[str, list[int]] = {}
        while eng.has_unfinished():
            for d in eng.step():
                tokens.setdefault(d.request_id, []).extend(d.token_ids)
        if eng.runner.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t, [tokens[f"{n}-{i}"] for i in range(len(prompts))]

    out["first_generate_s"], out["tokens"] = generate()
    out["warm_generate_s"], _ = generate()
    out["load_total_s"] = time.perf_counter() - t0
    out["fxgraph_hit"] = int(counters["inductor"]["fxgraph_cache_hit"])
    out["fxgraph_miss"] = int(counters["inductor"]["fxgraph_cache_miss"])
    out["artifacts_mb"] = len(engine.compile_cache or b"") / 1e6
    return out


def run_fresh(engine_dir: str, mode: str, triton_cache: str, inductor_cache: str) -> dict:
    env = {
        **os.environ,
        "TRITON_CACHE_DIR": triton_cache,
        "TORCHINDUCTOR_CACHE_DIR": inductor_cache,
        "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])),
    }
    t = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "bench.load", "--child", mode, "--engine", engine_dir],
        env=env, capture_output=True, text=True,
    )  # fmt: skip
    wall = time.perf_counter() - t
    if done.returncode:
        return {"mode": mode, "error": done.stderr[-3000:]}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["process_wall_s"] = wall
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--repeats", type=int, default=1, help="fresh processes per mode")
    ap.add_argument("--out")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.engine, args.child)), flush=True)
        return 0
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):
            warm_triton = None
            for mode in args.modes.split(","):
                caches = [tempfile.mkdtemp(dir=tmp) for _ in range(2)]
                if mode == "eager-warm" and warm_triton:
                    caches[0] = warm_triton
                result = run_fresh(args.engine, mode, *caches)
                if mode == "eager":
                    warm_triton = caches[0]
                print(f"[bench.load] {json.dumps(result)}", flush=True)
                runs.append(result)
    import torch

    results = {
        "command": " ".join(["python", "-m", "bench.load", *(sys.argv[1:] if argv is None else argv)]),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "date": time.strftime("%Y-%m-%d"),
        "runs": runs,
    }
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "load.json"), "w") as f:
            json.dump(results, f, indent=2)
        with open(os.path.join(args.out, "load.md"), "w") as f:
            f.write(table(results))
    print(table(results))
    return 0 if all("error" not in r for r in runs) else 1


def table(r: dict) -> str:
    ok = [x for x in r["runs"] if "error" not in x]
    same = len({json.dumps(x["tokens"]) for x in ok}) <= 1
    lines = [
        f"Command: `{r['command']}`; {r['device']}; {r['date']}. Tokens equal across modes: {same}.",
        "",
        "| mode | imports | from_dir | runner | first generate | warm generate | process wall | fxgraph hit/miss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for x in r["runs"]:
        if "error" in x:
            lines.append(f"| {x['mode']} | error: {x['error'].splitlines()[-1][:120]} | | | | | | |")
            continue
        lines.append(
            f"| {x['mode']} | {x['imports_s']:.1f} s | {x['from_dir_s']:.2f} s | {x['runner_s']:.2f} s | "
            f"{x['first_generate_s']:.1f} s | {x['warm_generate_s']:.3f} s | {x['process_wall_s']:.1f} s | "
            f"{x['fxgraph_hit']}/{x['fxgraph_miss']} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
