"""`python -m bench.long_needle`: needle in a haystack on the trained small real Inkling at long contexts,
the engine beside transformers fed in chunks, in one GPU run of at most ten minutes.

    python -m bench.long_needle --out build/long-needle                     # the GPU run (8K..1M)
    python -m bench.long_needle --device cpu --lengths 300,600 --depths 0.5 --out DIR     # a smoke run

data/inkling-small-published (the real architecture at width 128, trained on 2048-token rows; window 128,
relative extent 256, log-scaling floor 1024) is built into a float32 engine with max_seq_len the longest
length. Each prompt puts " The secret passkey is NNNNN. Remember it." at a depth of a held-out haystack
(pydoc's help topics, repeated where the length passes them) and ends with "...The secret passkey is". Per
prompt:
- the engine's greedy tokens, and whether they retrieve the passkey;
- up to --reference_max tokens of prompt, transformers' greedy tokens (inkling/published/long_reference.py:
  its own model and cache, fed --chunk tokens a call), and whether the engine's equal them token for token.
  Where they differ: the first position, and the reference's top-2 logit margin there (INKLING_SPEC §2's
  near tie).
Where the model stops retrieving is the model's property (it never saw more than 2,048 tokens); where the
engine and the reference part is the engine's. Writes results.json and results.md into --out, after each
prompt (a run cut short keeps what it measured).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch
from tokenizers import Tokenizer

from builder import BuildConfig, build
from runtime import LLM, PromptInput, SamplingParams
from train.data import ANSWER, Mixture
from train.published import CHECKPOINT, EOS, SEPARATOR, materialize

ANSWER_TOKENS = 8  # " NNNNN." and its end


def needle_prompt(mixture: Mixture, length: int, depth: float) -> tuple[list[int], list[int]]:
    """(prompt ids, the answer's ids) of a needle sample of about `length` tokens at `depth`."""
    sample = mixture.needle(length, depth=depth)
    first = sample.answer_positions[0]
    return sample.ids[:first], sample.ids[first : sample.answer_positions[-1] + 1]


def compare(engine_tokens: list[int], reference_tokens: list[int], margins: list[float]) -> dict:
    """Token-for-token equality, and where they part: the position and the reference's top-2 margin."""
    for i, (a, b) in enumerate(zip(engine_tokens, reference_tokens)):
        if a != b:
            return {"equal": False, "first_difference": i, "reference_margin": margins[i]}
    return {"equal": True}


@torch.no_grad()
def reference_greedy(model, prompt: list[int], n: int, chunk: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens after `prompt` fed in chunks, and each step's top-2 logit margin."""
    from inkling.published.long_reference import chunked_prefill

    logits, past = chunked_prefill(model, torch.tensor(prompt), chunk)
    tokens, margins = [], []
    while True:
        top = logits.topk(2).values
        margins.append(float(top[0] - top[1]))
        tokens.append(int(logits.argmax()))
        if len(tokens) == n:
            return tokens, margins
        out = model(
            input_ids=torch.tensor([tokens[-1:]], device=model.device),
            past_key_values=past,
            use_cache=True,
            logits_to_keep=1,
        )
        logits, past = out.logits[0, -1].float(), out.past_key_values


def write(out: str, rows: list[dict], meta: dict) -> None:
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({**meta, "results": rows}, f, indent=1)
    lines = [
        f"# Needle in a haystack on the trained small real Inkling (`{meta['command']}`)",
        "",
        f"{meta['device']}, {meta['dtype']} engine; reference: transformers {meta['transformers']} fed "
        f"{meta['chunk']}-token chunks, up to {meta['reference_max']} tokens of prompt.",
        "",
        "| tokens | depth | engine retrieves | reference retrieves | engine = reference | engine s | reference s |",
        "|---|---|---|---|---|---|---|",
    ]

    def yes(flag: bool | None) -> str:
        return "not run" if flag is None else "yes" if flag else "no"

    for r in rows:
        same = yes(r.get("equal"))
        if r.get("equal") is False:
            same += f": from token {r['first_difference']} (margin {r['reference_margin']:.2e})"
        ref_s = f"{r['reference_s']:.1f}" if "reference_s" in r else ""
        lines.append(
            f"| {r['tokens']} | {r['depth']} | {yes(r['engine_retrieves'])} | {yes(r.get('reference_retrieves'))} "
            f"| {same} | {r['engine_s']:.1f} | {ref_s} |"
        )
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="8192,32768,131072,524288,1048576")
    ap.add_argument("--depths", default="0.1,0.5,0.9")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--reference_max", type=int, default=1 << 20, help="longest prompt the reference runs on")
    ap.add_argument("--chunk", type=int, default=2048, help="the engine's prefill chunk (max_num_tokens)")
    ap.add_argument(
        "--reference_chunk",
        type=int,
        default=512,
        help="prompt tokens per reference call (each holds about 8 arrays of heads x chunk x context floats)",
    )
    ap.add_argument("--budget_s", type=float, default=540.0, help="no new prompt starts after this")
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    start = time.perf_counter()
    lengths = [int(x) for x in args.lengths.split(",")]
    depths = [float(x) for x in args.depths.split(",")]
    ckpt = materialize(CHECKPOINT, os.path.join(tempfile.mkdtemp(prefix="needle-"), "small"))
    longest = max(lengths) + 64
    config = BuildConfig(
        dtype=args.dtype, device=args.device, max_batch_size=1, max_seq_len=longest, max_input_len=longest,
        max_num_tokens=args.chunk,
    )  # fmt: skip
    llm = LLM(build(ckpt, config, echo=False))
    reference = None
    if min(lengths) <= args.reference_max:
        import transformers

        from inkling.published.reference import reference_model

        reference = reference_model(ckpt, getattr(torch, args.dtype)).to(args.device)
    tok = Tokenizer.from_file(os.path.join(ckpt, "tokenizer.json"))
    mixture = Mixture(tok, 2048, seed=args.seed, held_out=True, bos=SEPARATOR, eos=EOS)
    meta = {
        "command": "python -m bench.long_needle " + " ".join(argv if argv is not None else sys.argv[1:]),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "dtype": args.dtype,
        "chunk": args.reference_chunk,
        "reference_max": args.reference_max,
        "transformers": transformers.__version__ if reference is not None else None,
        "answer_text": ANSWER,
    }
    rows: list[dict] = []
    for length in lengths:
        for depth in depths:
            if time.perf_counter() - start > args.budget_s:
                print(f"budget spent: {length} tokens at depth {depth} not run", flush=True)
                continue
            prompt, answer = needle_prompt(mixture, length, depth)
            t0 = time.perf_counter()
            (out,) = llm.generate(
                [PromptInput(torch.tensor(prompt))], SamplingParams(max_tokens=ANSWER_TOKENS)
            )
            row = {
                "tokens": len(prompt),
                "depth": depth,
                "engine_tokens": list(out.token_ids),
                "answer_tokens": answer,
                "engine_retrieves": list(out.token_ids[: len(answer)]) == answer,
                "engine_s": time.perf_counter() - t0,
            }
            if reference is not None and len(prompt) <= args.reference_max:
                t0 = time.perf_counter()
                ref, margins = reference_greedy(reference, prompt, len(out.token_ids), args.reference_chunk)
                row.update(
                    reference_tokens=ref,
                    reference_retrieves=ref[: len(answer)] == answer,
                    reference_s=time.perf_counter() - t0,
                    **compare(row["engine_tokens"], ref, margins),
                )
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if not k.endswith("tokens")}), flush=True)
            write(args.out, rows, meta)
    llm.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
