"""Needle in a haystack on the trained small Inkling: retrieval accuracy by context length and depth,
the reference model and the engine side by side.

    python -m bench.needle --out build/needle                        # CPU, float32 engine
    python -m bench.needle --lengths 512,2048 --depths 0,1 --trials 1 --out DIR

The checkpoint (data/inkling-small, trained on 2048-token rows) is converted to NVFP4 by the converter
and built into an engine; both the engine and the reference model read that NVFP4 checkpoint. Prompts
put "The secret passkey is NNNNN." at a depth of a held-out haystack (pydoc help topics, text the model
never trained on) and end with "...The secret passkey is"; the answer is " NNNNN.".

Per prompt: the engine generates greedily; one reference forward over prompt + the engine's tokens says
whether every engine token is the reference's greedy choice (token-for-token equality, and where they
diverge: the first position, and whether the reference's top-2 logits were within 1e-4 there, a near
tie that INKLING_SPEC §2 lets a different summation order break either way). A second forward over
prompt + answer says whether the reference itself retrieves. Writes results.json, results.md, needle.png.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from dataclasses import dataclass

import torch

from inkling.model import InklingReference
from inkling.tokenizer import load_tokenizer
from train import SMALL_CHECKPOINT
from train.data import ANSWER, Mixture

NEAR_TIE = 1e-4
ANSWER_TOKENS = 8  # " NNNNN." spelled one character per token takes 7; then <|eos|>


def prepare_engine(
    work_dir: str, max_seq_len: int, *, device: str = "cpu", dtype: str = "float32", draft_vocab=None
):
    """NVFP4 conversion of the trained checkpoint (kept in work_dir) and an engine built in memory."""
    from builder import BuildConfig, build
    from convert import convert

    fp4 = os.path.join(work_dir, "inkling-small-nvfp4")
    if not os.path.exists(os.path.join(fp4, "config.json")):
        convert(SMALL_CHECKPOINT, fp4, quant="nvfp4", force=True)
    bc = BuildConfig(
        max_batch_size=16,
        max_input_len=max_seq_len,
        max_seq_len=max_seq_len + 16,
        max_num_tokens=max(2048, min(max_seq_len, 8192)),
        dtype=dtype,
        device=device,
    )
    return fp4, build(fp4, bc, echo=False, draft_vocab=draft_vocab)


@dataclass
class NeedlePrompt:
    length: int
    depth: float
    passkey: int
    prompt: list[int]
    answer: list[int]  # " NNNNN." (the <|eos|> that follows in training is not asked for)


def needle_prompts(tok, lengths, depths, trials: int, seed: int = 0) -> list[NeedlePrompt]:
    mixture = Mixture(tok, seq_len=max(lengths), seed=seed, held_out=True)
    rng = random.Random(seed)
    out = []
    for length in lengths:
        for depth in depths:
            for _ in range(trials):
                passkey = rng.randrange(10_000, 100_000)
                s = mixture.needle(length, depth=depth, passkey=passkey)
                answer = s.answer_positions
                out.append(
                    NeedlePrompt(length, depth, passkey, s.ids[: answer[0]], [s.ids[i] for i in answer])
                )
    return out


@torch.no_grad()
def reference_check(model: InklingReference, prompt: list[int], tokens: list[int]) -> tuple[int | None, bool]:
    """(first position where `tokens` leaves the reference's greedy path or None, near tie there)."""
    ids = torch.tensor(prompt + tokens[:-1])
    logits, _ = model(ids)
    logits = logits[len(prompt) - 1 :, : model.num_real_tokens]
    for i, token in enumerate(tokens):
        if int(logits[i].argmax()) != token:
            top2 = logits[i].topk(2).values
            return i, bool(top2[0] - top2[1] < NEAR_TIE)
    return None, False


def run(args) -> dict:
    from runtime import LLM, SamplingParams
    from runtime.engine import PromptInput

    lengths = [int(x) for x in args.lengths.split(",")]
    depths = [float(x) for x in args.depths.split(",")]
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    fp4, engine = prepare_engine(
        args.work_dir or args.out, max(lengths), device=args.device, dtype=args.dtype
    )
    tok = load_tokenizer(SMALL_CHECKPOINT)
    reference = InklingReference.from_pretrained(fp4, dtype=torch.float32, cache_dequantized=True)
    prompts = needle_prompts(tok, lengths, depths, args.trials, args.seed)
    llm = LLM(engine)
    rows = []
    for length in lengths:
        batch = [p for p in prompts if p.length == length]
        # The answer's own encoding may be shorter than the model's spelling of it (" 4" "8" vs " " "4" "8").
        params = SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0.0)
        outs = llm.generate([PromptInput(torch.tensor(p.prompt)) for p in batch], params)
        for p, out in zip(batch, outs):
            got = list(out.token_ids)
            # Retrieval is judged on the text: the model may spell " 48213." with other tokens than
            # the tokenizer's encoding of the answer (e.g. " 4" "8" rather than " " "4" "8").
            want = ANSWER.format(p.passkey)
            diverge, near_tie = reference_check(reference, p.prompt, got)
            if diverge is None:
                ref_text = tok.decode(got)
            else:
                ref_ids = reference.generate(torch.tensor(p.prompt), ANSWER_TOKENS)
                ref_text = tok.decode(ref_ids.tolist())
            rows.append(
                {
                    "length": length,
                    "depth": p.depth,
                    "passkey": p.passkey,
                    "engine": tok.decode(got),
                    "engine_correct": tok.decode(got).startswith(want),
                    "reference_correct": ref_text.startswith(want),
                    "engine_equals_reference": diverge is None,
                    "diverge_at": diverge,
                    "near_tie": near_tie,
                }
            )
        done = [r for r in rows if r["length"] == length]
        print(
            f"length {length}: engine {sum(r['engine_correct'] for r in done)}/{len(done)}, "
            f"reference {sum(r['reference_correct'] for r in done)}/{len(done)}, "
            f"engine == reference {sum(r['engine_equals_reference'] for r in done)}/{len(done)}",
            flush=True,
        )
    llm.shutdown()
    result = {
        "checkpoint": SMALL_CHECKPOINT,
        "trained_length": 2048,
        "engine": {"device": args.device, "dtype": args.dtype},
        "lengths": lengths,
        "depths": depths,
        "trials": args.trials,
        "seconds": round(time.perf_counter() - t0, 1),
        "rows": rows,
    }
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(markdown(result))
    plot(result, os.path.join(args.out, "needle.png"))
    return result


def _accuracy(rows, key, length, depth=None) -> float:
    sel = [r for r in rows if r["length"] == length and (depth is None or r["depth"] == depth)]
    return sum(r[key] for r in sel) / max(1, len(sel))


def markdown(result: dict) -> str:
    rows, depths = result["rows"], result["depths"]
    head = (
        "| length | "
        + " | ".join(f"depth {d:g}" for d in depths)
        + " | engine | reference | engine = reference |"
    )
    lines = [head, "|" + "---|" * (len(depths) + 4)]
    for length in result["lengths"]:
        cells = [
            f"{_accuracy(rows, 'engine_correct', length, d):.0%} / {_accuracy(rows, 'reference_correct', length, d):.0%}"
            for d in depths
        ]
        sel = [r for r in rows if r["length"] == length]
        same = sum(r["engine_equals_reference"] for r in sel)
        ties = sum(r["near_tie"] for r in sel)
        mark = " (beyond the trained length)" if length > result["trained_length"] else ""
        lines.append(
            f"| {length}{mark} | "
            + " | ".join(cells)
            + f" | {_accuracy(rows, 'engine_correct', length):.0%} | {_accuracy(rows, 'reference_correct', length):.0%}"
            + f" | {same}/{len(sel)}{f' ({ties} near ties)' if ties else ''} |"
        )
    diverged = [r for r in rows if not r["engine_equals_reference"]]
    note = (
        "Cells: engine / reference retrieval accuracy. "
        f"{len(diverged)} prompt(s) where the engine left the reference's greedy path"
        + (
            ": "
            + "; ".join(
                f"length {r['length']} depth {r['depth']:g} at token {r['diverge_at']}" for r in diverged
            )
            if diverged
            else ""
        )
        + ".\n"
    )
    return "\n".join(lines) + "\n\n" + note


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths, depths, rows = result["lengths"], result["depths"], result["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2), dpi=90, sharey=True)
    for ax, (key, title) in zip(axes, [("reference_correct", "reference"), ("engine_correct", "engine")]):
        grid = [[_accuracy(rows, key, length, d) for length in lengths] for d in depths]
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto", origin="lower")
        ax.set_xticks(range(len(lengths)), [str(x) for x in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
        ax.set_xlabel("context length (tokens)")
        ax.set_title(f"{title}: passkey retrieval")
        trained = sum(1 for x in lengths if x <= result["trained_length"]) - 0.5
        ax.axvline(trained, color="white", linestyle="--", linewidth=1)
    axes[0].set_ylabel("needle depth")
    fig.colorbar(im, ax=axes, shrink=0.8, label="accuracy")
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.needle", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--work_dir", default=None, help="where the NVFP4 checkpoint goes (default: --out)")
    p.add_argument("--lengths", default="256,512,1024,2048,3072,4096")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1")
    p.add_argument("--trials", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    args = p.parse_args(argv)
    result = run(args)
    print(markdown(result))


if __name__ == "__main__":
    main()
