"""Soak through the OpenAI-compatible API: thousands of requests, some cancelled midway, with resident
memory and the block pool watched.

    python -m bench.soak_openai --engine build/engine-tiny --requests 5000 --out DIR

Starts Triton and the OpenAI front (model_repo/serve.py) on the engine and sends `--requests` requests
from `--clients` threads with the official `openai` client: completions and chat, streamed and unary,
greedy and seeded sampling, stop strings, logprobs, 1-16 new tokens; a fifth of the streams (--cancel)
are closed after their first chunk (a client gone midway: the front cancels the Triton request, which frees its
blocks), and one request in fifty is bad (an unknown model, a top_p of 0) and must get its 4xx. A request
that fails otherwise (a 5xx, a broken connection) is counted and the soak goes on. After
each `--every` requests, with nothing in flight, it records the resident memory of every process of the
deployment (tritonserver with its stubs and engine process, the front) and checks that no request left
anything behind: no block held outside the prefix cache, no request running or waiting. A figure, not
a test (tests/e2e/test_openai_api.py checks a disconnect frees its blocks).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import re
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from model_repo.serve import OpenAIServer, ServeConfig, TritonServer, free_port

MODEL = "inkling"
WORDS = "the printing press history of a river number seven light over and what follows it".split()


def tree_rss_mb(root: int) -> dict[str, float]:
    """Resident memory (MB) of `root` and every process under it, by command name."""
    children: dict[int, list[int]] = {}
    names: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name, rest = stat.split("(", 1)[1].rsplit(")", 1)
        children.setdefault(int(rest.split()[1]), []).append(int(entry))
        names[int(entry)] = name
    out: dict[str, float] = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            with open(f"/proc/{pid}/status") as f:
                kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            continue
        key = f"{names.get(pid, '?')}[{pid}]"
        out[key] = kb / 1024
    return out


def engine_state(metrics_url: str) -> dict[str, float]:
    """Blocks held outside the prefix cache, and requests running or waiting (Triton's inkling_* gauges)."""
    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        text = r.read().decode()
    m = {k: float(v) for k, v in re.findall(r'^(inkling_\w+\{\w+="\w+"\}) (\S+)$', text, re.M)}
    blocks = lambda kind: m[f'inkling_kv_cache_blocks{{kv_cache_block_type="{kind}"}}']
    return {
        "held": blocks("used") - blocks("evictable"),
        "in_flight": m['inkling_requests{request_state="running"}']
        + m['inkling_requests{request_state="waiting"}'],
    }


def settled(metrics_url: str, timeout: float = 20.0) -> dict[str, float]:
    """engine_state once nothing is held or in flight, or as it is after `timeout` (a leak)."""
    deadline = time.monotonic() + timeout
    while True:
        s = engine_state(metrics_url)
        if (s["held"] == 0 and s["in_flight"] == 0) or time.monotonic() > deadline:
            return s
        time.sleep(0.2)


def one_request(client, rng: random.Random, cancel: float) -> str:
    """One random request; returns its outcome: "ok", "cancelled" or "refused" (a bad request's 4xx)."""
    import openai

    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 24)))
    kw: dict = {"model": MODEL, "max_tokens": rng.randint(1, 16)}
    if rng.random() < 0.5:
        kw |= {"temperature": 0.8, "seed": rng.randrange(1 << 30)}
    else:
        kw["temperature"] = 0
    if rng.random() < 0.1:
        kw["stop"] = [rng.choice(WORDS)]
    chat = rng.random() < 0.5
    if rng.random() < 0.1:
        kw |= {"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2}
    if rng.random() < 0.02:
        kw |= rng.choice([{"model": "gpt-4"}, {"top_p": 0}])
        try:
            make(client, chat, prompt, kw)
        except (openai.BadRequestError, openai.NotFoundError, openai.UnprocessableEntityError):
            return "refused"
        raise AssertionError(f"a bad request was served: {kw}")
    if rng.random() < 0.5:
        stream = make(client, chat, prompt, kw | {"stream": True})
        if rng.random() < cancel:
            next(iter(stream))
            stream.close()  # a client gone midway
            return "cancelled"
        list(stream)
        return "ok"
    make(client, chat, prompt, kw)
    return "ok"


def make(client, chat: bool, prompt: str, kw: dict):
    if chat:
        return client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **kw)
    return client.completions.create(prompt=prompt, **kw)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine", default="build/engine-tiny")
    p.add_argument("--requests", type=int, default=5000)
    p.add_argument("--clients", type=int, default=16, help="threads sending requests at once")
    p.add_argument("--every", type=int, default=500, help="requests between readings")
    p.add_argument("--cancel", type=float, default=0.2, help="the share of streams closed after a chunk")
    p.add_argument("--engine-threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="build/soak-openai")
    args = p.parse_args(argv)
    import openai

    os.makedirs(args.out, exist_ok=True)
    cfg = ServeConfig(engine_dir=args.engine, work_dir=tempfile.mkdtemp(), http_port=free_port(),
                      grpc_port=free_port(), metrics_port=free_port(), engine_threads=args.engine_threads)  # fmt: skip
    readings, failures = [], []
    outcomes = {"ok": 0, "cancelled": 0, "refused": 0, "failed": 0}
    lock = threading.Lock()
    with TritonServer(cfg, log_path=os.path.join(args.out, "tritonserver.log")) as server:
        with OpenAIServer(cfg, free_port(), MODEL, log_path=os.path.join(args.out, "openai.log")) as front:
            client = openai.OpenAI(base_url=front.url, api_key="unused", max_retries=0, timeout=300)

            def run(i: int) -> None:
                try:
                    outcome = one_request(client, random.Random(args.seed * 1_000_003 + i), args.cancel)
                except openai.APIError as e:  # a 5xx or a broken connection: counted, and the soak goes on
                    outcome = "failed"
                    with lock:
                        if len(failures) < 20:
                            failures.append(f"request {i}: {type(e).__name__}: {e}"[:500])
                with lock:
                    outcomes[outcome] += 1

            t0 = time.monotonic()
            with ThreadPoolExecutor(args.clients) as pool:
                for start in range(0, args.requests, args.every):
                    list(pool.map(run, range(start, min(start + args.every, args.requests))))
                    state = settled(cfg.metrics_url)
                    rss = tree_rss_mb(server.process.pid) | tree_rss_mb(front.process.pid)
                    readings.append({"requests": min(start + args.every, args.requests),
                                     "seconds": round(time.monotonic() - t0, 1), **state,
                                     "rss_mb_total": round(sum(rss.values()), 1),
                                     "rss_mb": {k: round(v, 1) for k, v in rss.items()}})  # fmt: skip
                    r = readings[-1]
                    print(f"{r['requests']:6d} requests {r['seconds']:7.1f} s  held {r['held']:.0f}  in flight "
                          f"{r['in_flight']:.0f}  RSS {r['rss_mb_total']:.1f} MB  {dict(outcomes)}", flush=True)  # fmt: skip
    result = {"date": datetime.date.today().isoformat(), "args": vars(args), "outcomes": outcomes,
              "failures": failures, "readings": readings}  # fmt: skip
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    leaked = [r for r in readings if r["held"] or r["in_flight"]]
    print("no leaked blocks or requests" if not leaked else f"LEAKED at {[r['requests'] for r in leaked]}")
    print(f"{outcomes['failed']} requests failed" + "".join(f"\n  {f}" for f in failures))
    return 1 if leaked or outcomes["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
