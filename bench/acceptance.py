"""MTP acceptance of the trained small real Inkling, measured with the runtime (engine, verify, accept).

    python -m bench.acceptance --out build/acceptance          # CPU, float32 engine, greedy

data/inkling-small-published (train/published.py: the real architecture with its 8 trained MTP depths) is
built into an engine. Prompts lie within the trained length (2048) and come from text the model did not
train on (pydoc help topics) or from fresh task samples: text continuation, counting, arithmetic sequences,
copying, sums. For each num_draft_tokens k in --drafts, the engine generates greedily with MTP twice: with
the runtime's adaptive policy on its acceptance side (what a request's acceptance alone decides; the cost
side, runtime/speculative.py RoundCosts, depends on the batch and the device) and with k drafts every step
(the policy replaced by "always k", to read the depths' quality); the outputs must equal plain decoding's
(checked). Reported: mean acceptance length (tokens per step, bonus included) and the unconditional
acceptance rate of each draft position (accepted / proposed). Writes results.json, results.md and
acceptance.png into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
from tokenizers import Tokenizer

from runtime.speculative import AcceptanceStats, draft_every_step, next_num_drafts
from train.data import Mixture
from train.published import CHECKPOINT, EOS, SEPARATOR, materialize

TASKS = ("text", "count", "sequence", "copy", "sums")


def task_prompts(tok, task: str, n: int, seed: int = 0) -> list[list[int]]:
    """`n` prompts of one task: a sample cut where its answer (or the text) is under way."""
    mixture = Mixture(tok, seq_len=2048, seed=seed, held_out=True, bos=SEPARATOR, eos=EOS)
    prompts = []
    for _ in range(n):
        if task == "text":
            prompts.append(mixture.text_sample(384).ids)
            continue
        s = getattr(mixture, task)()
        prompts.append(s.ids[: s.answer_positions[0] + 2])
    return prompts


def training_vocab(tok, size: int, seed: int, rows: int = 64) -> list[int]:
    """A draft vocabulary (builder/draft_vocab.py): the `size` most frequent tokens of `rows` rows of the
    training mixture (its tasks and text in their training proportions), special tokens always in."""
    from collections import Counter

    from builder.draft_vocab import most_frequent

    ids, _ = Mixture(tok, seq_len=2048, seed=seed + 1, bos=SEPARATOR, eos=EOS).batch(rows)
    return most_frequent(Counter(ids.flatten().tolist()), size, tok.get_added_tokens_decoder())


def measure(llm, prompts, k: int, max_tokens: int, fixed: bool) -> tuple[dict, list[list[int]]]:
    from runtime import SamplingParams
    from runtime.engine import PromptInput

    spec = llm.engine.spec
    spec.acceptance = AcceptanceStats()
    spec.draft_policy = draft_every_step if fixed else next_num_drafts
    spec.round_costs = None  # acceptance alone: what the depths predict, not what pays at this batch
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, num_draft_tokens=k)
    t0 = time.perf_counter()
    outs = llm.generate([PromptInput(torch.tensor(p)) for p in prompts], params)
    seconds = time.perf_counter() - t0
    acc = llm.engine.acceptance
    stats = {
        "mean_acceptance_length": acc.mean_acceptance_length if acc.steps else 1.0,
        "acceptance_rates": [round(r, 3) for r in acc.acceptance_rates[:k]],
        "steps": acc.steps,
        "tokens": sum(len(o.token_ids) for o in outs),
        "seconds": round(seconds, 2),
    }
    return stats, [list(o.token_ids) for o in outs]


def prepare_engine(work: str, device: str, dtype: str, draft_vocab: list[int] | None = None):
    """The committed checkpoint made whole (`materialize`) under `work`, built for prompts of up to 2K."""
    from builder import BuildConfig, build

    ckpt = materialize(CHECKPOINT, os.path.join(work, "inkling-small-published"), force=True)
    bc = BuildConfig(
        dtype=dtype, device=device, max_batch_size=8, max_input_len=2048, max_seq_len=2304,
        max_num_tokens=2048, max_draft_len=8,
    )  # fmt: skip
    return ckpt, build(ckpt, bc, echo=False, draft_vocab=draft_vocab)


def run(args) -> dict:
    from runtime import LLM

    os.makedirs(args.out, exist_ok=True)
    drafts = [int(x) for x in args.drafts.split(",")]
    tok = Tokenizer.from_file(os.path.join(CHECKPOINT, "tokenizer.json"))
    vocab = training_vocab(tok, args.draft_vocab_size, args.seed) if args.draft_vocab_size else None
    with tempfile.TemporaryDirectory() as scratch:
        _, engine = prepare_engine(args.work_dir or scratch, args.device, args.dtype, vocab)
    llm = LLM(engine)
    results: dict = {"checkpoint": CHECKPOINT, "device": args.device, "dtype": args.dtype, "tasks": {}}
    if vocab is not None:
        results["draft_vocab_size"] = len(vocab)
    for task in TASKS:
        prompts = task_prompts(tok, task, args.prompts, args.seed)
        base, plain = measure(llm, prompts, 0, args.max_tokens, fixed=False)
        entry = {"prompts": len(prompts), "plain": base}
        for k in drafts:
            for mode in ("adaptive", "fixed"):
                stats, outs = measure(llm, prompts, k, args.max_tokens, fixed=mode == "fixed")
                stats["equals_plain"] = outs == plain
                entry[f"k{k}_{mode}"] = stats
                print(
                    f"{task:8s} k={k} {mode:8s}: acceptance length {stats['mean_acceptance_length']:.2f}, "
                    f"rates {stats['acceptance_rates']}, equal to plain: {stats['equals_plain']}",
                    flush=True,
                )
        results["tasks"][task] = entry
    llm.shutdown()
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(markdown(results, drafts))
    plot(results, drafts, os.path.join(args.out, "acceptance.png"))
    return results


def markdown(results: dict, drafts: list[int]) -> str:
    head = (
        "| task | "
        + " | ".join(f"k={k} adaptive | k={k} fixed" for k in drafts)
        + f" | rates per position (k={max(drafts)} fixed) |"
    )
    lines = [head, "|" + "---|" * (2 * len(drafts) + 2)]
    for task, entry in results["tasks"].items():
        cells = []
        for k in drafts:
            for mode in ("adaptive", "fixed"):
                s = entry[f"k{k}_{mode}"]
                cells.append(
                    f"{s['mean_acceptance_length']:.2f}" + ("" if s["equals_plain"] else " (≠ plain!)")
                )
        rates = entry.get(f"k{max(drafts)}_fixed", {}).get("acceptance_rates", [])
        lines.append(f"| {task} | " + " | ".join(cells) + " | " + " ".join(f"{r:.2f}" for r in rates) + " |")
    return (
        "\n".join(lines)
        + "\n\nMean acceptance length: tokens per verify step, bonus included (1.0 = no draft accepted).\n"
    )


def plot(results: dict, drafts: list[int], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = max(drafts)
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=90)
    for task, entry in results["tasks"].items():
        rates = entry.get(f"k{k}_fixed", {}).get("acceptance_rates", [])
        ax.plot(range(1, len(rates) + 1), rates, marker="o", label=task)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate (accepted / proposed)")
    ax.set_ylim(0, 1)
    ax.set_title(f"inkling-small-published MTP acceptance, k={k} drafts every step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.acceptance", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--work_dir", default=None)
    p.add_argument("--drafts", default="1,3,8")
    p.add_argument("--prompts", type=int, default=8, help="prompts per task")
    p.add_argument("--max_tokens", type=int, default=96)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument(
        "--draft_vocab_size",
        type=int,
        default=0,
        help="draft from the N most frequent training tokens only (builder/draft_vocab.py); 0: every token",
    )
    args = p.parse_args(argv)
    results = run(args)
    print(markdown(results, [int(x) for x in args.drafts.split(",")]))


if __name__ == "__main__":
    main()
