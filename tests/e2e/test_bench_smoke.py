"""`make bench` in its CPU smoke shape: the whole script runs and writes its table."""

import json
from pathlib import Path

import pytest

from bench.e2e import _decode_rows, _requested_batches, main, user_prompts, write_table
from inkling.published.config import preset


def test_e2e_benchmark_parts_and_merge(tmp_path):
    """`make bench`'s two parts (Makefile: bench-decode, bench-mtp) on the real Inkling in the CPU smoke shape,
    then `--merge` into one table and plot."""
    import runtime.spec_decode

    common = ["--preset", "inkling-tiny", "--device", "cpu"]
    # the decode part (profiled here too)
    argv = [*common, "--prompt_len", "96", "--output_len", "14", "--batches", "1,2", "--profile_batch", "2",
            "--profile_prefill", "--out", str(tmp_path / "decode")]  # fmt: skip
    assert main(argv) == 0
    r = json.loads((tmp_path / "decode" / "results.json").read_text())
    assert set(r["ttft_s"]) == {"prompt 1", "prompt 2", "prompt 3"} and set(r["decode"]) == {"1", "2"}
    assert r["decode"]["1"]["tokens_per_request"] == 14 and r["decode"]["1"]["decode_steps_timed"] == 13
    assert r["decode"]["2"]["decode_steps_timed"] == 13 - 4  # 4 steps profiled, not timed
    assert all(d["throughput_tokens_per_s"] > 0 for d in r["decode"].values())
    assert "4 decode steps at batch 2" in (tmp_path / "decode" / "profile_batch2.txt").read_text()
    assert "1 prefill of 96 tokens" in (tmp_path / "decode" / "profile_prefill.txt").read_text()
    table = (tmp_path / "decode" / "results.md").read_text()
    assert "time to first token" in table and "; greedy." in table and "the real Inkling" in table
    bounds = r["bound"]["decode_batch_step_s"]  # batch 2: more experts and KV than batch 1, less than twice
    assert bounds["1"] < bounds["2"] < 2 * bounds["1"] and "| throughput tokens/s, batch 2 |" in table
    assert f"(step {bounds['2'] * 1e3:.3g} ms)" in table
    # the bound again with the experts the decode's routing touched (inkling-tiny: 16 experts, top 6)
    routed = r["decode"]["2"]
    assert 6 <= routed["routed_distinct_experts"] <= 16 and routed["step_bound_routed_s"] > 0
    assert "against the bound of its measured routing" in table

    # the MTP part: the preset's depths are synthesized; random depths accept little, so tokens per step stay
    # near 1 (acceptance length >= 1 by the bonus token). --fixed_drafts keeps drafting (the adaptive policy
    # restored afterwards).
    policy = runtime.spec_decode.next_num_drafts
    argv = [*common, "--prompt_len", "64", "--output_len", "10", "--batches", "2", "--num_draft_tokens", "2",
            "--fixed_drafts", "--temperature", "1", "--draft_vocab_size", "500",
            "--out", str(tmp_path / "mtp")]  # fmt: skip
    assert main(argv) == 0
    assert runtime.spec_decode.next_num_drafts is policy
    m = json.loads((tmp_path / "mtp" / "results.json").read_text())
    d = m["decode"]["2"]
    assert d["tokens_per_request"] == 10 and 1.0 <= d["acceptance_length"] <= 3.0 and m["fixed_drafts"]
    assert m["draft_vocab_size"] == 500
    assert d["mtp_steps"] >= 2 * d["decode_steps_timed"]  # both requests drafted in every timed step
    # the tail's steps, each with the drafts it verified (2 sequences, 2 drafts, fixed: 4 but near the end)
    assert all(dt > 2 * d["step_s_median"] and 0 <= n <= 4 for _, dt, n in d["step_s_slow"])
    # sampled (a seed per user), and the batch's distinct tokens a step recorded and shown
    assert m["temperature"] == 1.0 and 1 <= d["distinct_tokens_median"] <= 2
    table = (tmp_path / "mtp" / "results.md").read_text()
    assert "sampled at temperature 1, a seed per user" in table and "distinct tokens a step: median" in table

    assert main(["--merge", "--out", str(tmp_path)]) == 0
    merged = (tmp_path / "results.md").read_text()
    for part in ("decode", "mtp"):
        assert f"- part {part}: `python -m bench.e2e " in merged
    assert "| time to first token, prompt 1 |" in merged and "| decode tokens/s per user, batch 1 " in merged
    assert (
        "| with 2 MTP drafts a step (every step) from 500 tokens, MTP acceptance length, batch 2 |" in merged
    )
    assert set(json.loads((tmp_path / "results.json").read_text())["parts"]) == {"decode", "mtp"}
    assert (tmp_path / "e2e.png").stat().st_size > 10_000


def test_tp_benchmark_smoke(tmp_path):
    """bench.tp on the CPU: tp 1 in memory, tp 2 saved, loaded and run by its two ranks; same tokens."""
    from bench.tp import main as tp_main

    argv = ["--preset", "inkling-tiny", "--device", "cpu", "--tp", "2", "--context", "48", "--tokens", "4",
            "--work", str(tmp_path / "engines"), "--out", str(tmp_path)]  # fmt: skip
    assert tp_main(argv) == 0
    r = json.loads((tmp_path / "results.json").read_text())
    assert r["runs"]["2"]["tokens_equal_tp1"] and r["runs"]["2"]["tokens_per_request"] == 4
    assert not (tmp_path / "engines" / "tp2").exists()  # removed after the run


def test_load_benchmark_smoke(engine_f32, tmp_path):
    """bench.load in fresh processes, eager modes (the compile modes take a minute each on the CPU): the
    same tokens from a cold and a warm start, and its table."""
    from bench.load import main as load_main

    argv = ["--engine", str(engine_f32[1]), "--modes", "eager,eager-warm", "--out", str(tmp_path)]
    assert load_main(argv) == 0
    runs = json.loads((tmp_path / "load.json").read_text())["runs"]
    assert [r["mode"] for r in runs] == ["eager", "eager-warm"]
    assert runs[0]["tokens"] == runs[1]["tokens"] and len(runs[0]["tokens"][0]) == 3
    assert "Tokens equal across modes: True" in (tmp_path / "load.md").read_text()


def test_host_benchmark_smoke(engine_f32, tmp_path):
    """bench.host: host time per step beside the programs, and the operators it dispatches. The staged
    graph inputs keep a decode step's launches outside the program to a handful whatever the batch (the
    NumPy-built inputs, one copy into the bucket, the output copies); the count would grow with the
    batch again if the inputs were built or padded by torch calls a sequence."""
    import runtime.spec_decode
    from bench.host import main as host_main

    policy = runtime.spec_decode.next_num_drafts
    argv = ["--engine", str(engine_f32[1]), "--batch", "1", "3", "--drafts", "0", "2", "--steps", "3",
            "--out", str(tmp_path)]  # fmt: skip
    assert host_main(argv) == 0
    assert runtime.spec_decode.next_num_drafts is policy
    rows = {(r["batch"], r["drafts"]): r for r in json.loads((tmp_path / "host.json").read_text())["results"]}
    assert set(rows) == {(1, 0), (1, 2), (3, 0), (3, 2)}
    for (_, drafts), r in rows.items():
        ops = r["ops_per_step"]
        assert r["host_ms_run"] > 0 and (r["host_ms_run_heads"] > 0) == (drafts > 0)
        assert ops.get("run:kernel", 0) <= 4 and ops.get("run:readback", 0) == 0, ops
        assert (ops.get("run_heads:kernel", 0) > 0) == (drafts > 0)
    assert "| 3 | 2 |" in (tmp_path / "host.md").read_text()


def test_sm90_report_smoke(tmp_path):
    """bench.sm90 compiles the attention kernel for sm_90 without a GPU (as the launcher would launch the
    chunked-table prefill, here with a bf16 table) and reads registers and PTX counts: it breaks when the
    kernel's arguments and the launcher's constexprs drift apart."""
    from bench.sm90 import main as sm90_main

    only = "chunk_tiles=7, unmasked_chunks=True, table_dtype='bfloat16'"
    assert sm90_main(["--seq", "1024", "--only", only, "--out", str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / "sm90.json").read_text())["rows"]
    assert 0 < row["registers"] <= 255 and row["shared_bytes"] > 0 and row["wgmma"] > 0
    assert "chunk_tiles=7" in (tmp_path / "sm90.md").read_text()


def test_sm90_gluon_launches_compile(tmp_path):
    """The Gluon launches (plugins/attention/gluon_attention.py, which no interpreter runs) compile for sm_90
    as the launcher launches them on the real full layer: both GEMMs (and the near launch's relative band) on
    wgmma, K/V by cp.async, no spills; the far launch at least two programs an SM, three with Q in
    registers."""
    from bench.sm90 import main as sm90_main

    assert sm90_main(["--seq", "8192", "--only", "gluon", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "sm90.json").read_text())["rows"]
    far = [r for r in rows if "far_impl='gluon'" in r["variant"]]
    near = [r for r in rows if "near_impl='gluon'" in r["variant"]]
    assert len(far) == 4 and len(near) == 4
    for row in rows:
        assert 0 < row["registers"] <= 255 and row["spill_bytes"] == 0 and row["mma.sync"] == 0
        assert row["wgmma"] > 0 and row["cp.async"] > 0
    assert all(
        r["registers"] <= 168 and min(r["programs_by_registers"], r["programs_by_shared"]) >= 2 for r in far
    )
    assert far[2]["shared_bytes"] == far[0]["shared_bytes"] - 64 * 128 * 2  # Q in registers: 16 KB less
    assert min(far[2]["programs_by_registers"], far[2]["programs_by_shared"]) == 3
    assert all(r["wgmma"] > far[0]["wgmma"] for r in near)  # the band's own wgmma
    # the band in bf16 with Q in registers: two programs an SM
    assert min(near[3]["programs_by_registers"], near[3]["programs_by_shared"]) == 2


@pytest.mark.parametrize("head_dim", [16, 32])
def test_sm90_gluon_launches_compile_small_heads(tmp_path, head_dim):
    """Heads narrower than a 128-byte shared-memory row (the tiny model's 16, which the GPU engine test builds
    with --attention_plugin gluon): the K/V, Q and band tiles take the swizzle their rows allow. With a fixed
    128-byte swizzle both launches failed to compile ("Block shape is too small for the swizzle byte size")."""
    from bench.sm90 import main as sm90_main

    assert sm90_main(["--only", "gluon", "--head_dim", str(head_dim), "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "sm90.json").read_text())["rows"]
    assert len(rows) == 8 and all(r["spill_bytes"] == 0 and r["wgmma"] > 0 for r in rows)


def test_sm90_decode_report(tmp_path):
    """bench.sm90 --decode: the batch-1 decode over 8K keys as the launcher launches it (64 splits), the
    GEMV of the relative term over all of d_rel's 16 columns and 8 at a time (rel_slice). At the earlier
    model's Dr of 32 the slice saved registers (168 against 254); at the real d_rel of 16 both forms hold
    168, so the slice may not cost registers, and the table says how many programs fit on an SM."""
    from bench.sm90 import main as sm90_main

    variant = (
        "block_n=64, num_splits=64, num_warps=4, num_stages=2, shear='gather', chunk_tiles=3, "
        "unmasked_chunks=True, table_dtype='float32', rel_dot=False, rel_gemv=False, rel_slice={}"
    )
    rows = {}
    for rel_slice in (0, 8):
        only = variant.format(rel_slice)
        out = tmp_path / str(rel_slice)
        assert sm90_main(["--decode", "8192", "--only", only, "--out", str(out)]) == 0
        (rows[rel_slice],) = json.loads((out / "sm90.json").read_text())["rows"]
    assert 0 < rows[8]["registers"] <= rows[0]["registers"] <= 255
    assert rows[8]["programs_by_registers"] >= rows[0]["programs_by_registers"] >= 1
    assert "a batch-1 decode over 8192 keys" in (tmp_path / "8" / "sm90.md").read_text()


def test_sm90_moe_report_smoke(tmp_path):
    """bench.sm90_moe compiles the MoE grouped GEMM for sm_90 without a GPU and counts its K loop's SASS:
    every launch's loop has its tensor-core instructions, and the NVFP4 GEMM 1's loop carries the
    dequantization on top of what the bf16 one runs."""
    from bench.sm90_moe import main as sm90_moe_main

    assert sm90_moe_main(["--tile", "64,64,64,4,2", "--out", str(tmp_path)]) == 0
    rows = {r["launch"]: r for r in json.loads((tmp_path / "sm90_moe.json").read_text())}
    assert all(r["loop_mix"].get("HGMMA", 0) > 0 for r in rows.values()), rows
    assert rows["gemm1 routed (NVFP4)"]["loop_body"] > 2 * rows["gemm1 shared (bf16)"]["loop_body"]
    # the NVFP4 decode by byte lookups (inline PTX, assembled here): bf16 products, no float32 ones
    mix = rows["gemm1 routed (NVFP4)"]["loop_mix"]
    assert mix.get("PRMT", 0) >= 64 and mix.get("HMUL2", 0) > 0 and "FMUL" not in mix, mix
    # the decode kernel at T = 1 (tune()'s flags): tensor-core instructions in both launches' loops
    assert sm90_moe_main(["--bd", "--out", str(tmp_path / "bd")]) == 0
    bd = json.loads((tmp_path / "bd" / "sm90_moe.json").read_text())
    assert len(bd) == 2 and all(r["loop_mix"].get("HGMMA", 0) > 0 for r in bd), bd
    # its scale_w form (the batch buckets' default): the codes times their scales stay in registers as the
    # dot's operand (a first form sent them through shared memory: 288 stores a thread and K step)
    assert sm90_moe_main(["--sw", "--out", str(tmp_path / "sw")]) == 0
    sw = json.loads((tmp_path / "sw" / "sm90_moe.json").read_text())
    assert len(sw) == 2 and all(r["loop_mix"].get("HGMMA", 0) > 0 for r in sw), sw
    assert all(r["loop_mix"].get("STS", 0) <= 32 and r["loop_mix"].get("HMUL2", 0) > 0 for r in sw), sw


def test_decode_batches_have_one_prompt_a_user():
    """A decode batch's users each decode their own prompt (the MoE reads the experts a real batch routes to),
    of ordinary tokens below the special ones."""
    c = preset("inkling-tiny")
    users = user_prompts(c, 300, 32, seed=0)
    assert len({tuple(u.tolist()) for u in users}) == 32 and all(len(u) == 300 for u in users)
    assert max(int(u.max()) for u in users) < c.text.num_real_tokens - 64 <= c.eos_token_id


def test_batch_above_its_bound_is_flagged():
    """A throughput row above its batch's bound (the batch read fewer experts than uniform routing gives its
    users) says it is not a figure: the 2026-12-01 greedy batch 32 on the H200 (105.5%), from its committed
    results; the batch-8 row below the bound is not flagged."""
    path = Path(__file__).parents[2] / "bench/results/gpu-2026-12-01/bench-decode/bench/decode/results.json"
    rows = {line.split(" | ")[0]: line for line in _decode_rows(json.loads(path.read_text()), "")}
    assert "105.5% (above the bound" in rows["| throughput tokens/s, batch 32"]
    assert "above the bound" not in rows["| throughput tokens/s, batch 8"]


def test_merged_table_names_batches_a_part_did_not_measure(tmp_path):
    """The 2026-12-02 make bench on the H200 (committed results): the MTP part ran out of memory after its
    batches 1 and 8, so the merged table says batches 32 and 64 were not measured; the decode part, which
    measured all four, says nothing. Old parts without "batches" are read from their command."""
    root = Path(__file__).parents[2] / "bench/results/gpu-2026-12-02"
    parts = {
        "decode": json.loads((root / "bench-decode/bench/decode/results.json").read_text()),
        "mtp": json.loads((root / "bench-mtp/bench/mtp/results.json").read_text()),
    }
    assert "batches" not in parts["mtp"]
    merged = {**parts["decode"], "reference": {}, "parts": parts}
    write_table(merged, tmp_path / "results.md", mtp=parts["mtp"])
    lines = {line.split(":")[0]: line for line in (tmp_path / "results.md").read_text().splitlines()}
    assert lines["- part mtp"].endswith(
        "; batches 32, 64 not measured (the run ended before them: see its log)"
    )
    assert "not measured" not in lines["- part decode"]
    assert _requested_batches({**parts["mtp"], "batches": [1, 8]}) == [1, 8]


def test_a_part_completed_by_a_later_run(tmp_path):
    """A later 2026-12-02 run on the H200 (committed results): the first run's MTP part ended after batches 1 and 8, and a
    run of batches 32 and 64 alone completed it. `--merge` reads the second from DIR/mtp-2: the table lists
    both runs with the batches each gave, has all four batches' MTP rows, and says nothing is missing."""
    root = Path(__file__).parents[2] / "bench/results/gpu-2026-12-02"
    parts = {
        "decode": root / "bench-decode/bench/decode",
        "mtp": root / "bench-mtp/bench/mtp",
        "mtp-2": root / "s22/bench-mtp/bench/mtp",
    }
    for name, src in parts.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text((src / "results.json").read_text())
    assert main(["--merge", "--out", str(tmp_path)]) == 0
    lines = (tmp_path / "results.md").read_text().splitlines()
    runs = [line for line in lines if line.startswith("- part mtp:")]
    assert len(runs) == 2 and runs[0].endswith(": batches 1, 8") and runs[1].endswith(": batches 32, 64")
    assert "--batches 32,64" in runs[1] and not any("not measured" in line for line in lines)
    for batch in (1, 8, 32, 64):
        assert any(line.startswith(f"| with 3 MTP drafts a step (every step) from 32768 tokens, MTP acceptance length, batch {batch} |")
                   for line in lines)  # fmt: skip
    merged = json.loads((tmp_path / "results.json").read_text())
    assert sorted(merged["parts"]["mtp"]["decode"], key=int) == ["1", "8", "32", "64"]
    assert merged["parts"]["mtp"]["batches"] == [1, 8, 32, 64]


def test_long_context_benchmark_smoke(tmp_path):
    """`make bench-long-context` in a CPU smoke shape: every phase runs, the longest context last, and the
    table, plot and profile are written; the neighbour's second run keeps its prompt's chunks within
    max_prefill_pairs, its third paces them too."""
    from bench.long_context import main as long_context

    argv = ["--preset", "inkling-tiny", "--device", "cpu", "--contexts", "96,320", "--users", "2",
            "--users_context", "128", "--neighbour_context", "320", "--chunk", "64", "--output_len", "3",
            "--out", str(tmp_path)]  # fmt: skip
    assert long_context(argv) == 0
    r = json.loads((tmp_path / "results.json").read_text())
    assert [c["context"] for c in r["contexts"]] == [96, 320]
    assert all(c["itl_s"]["n"] == 3 and c["ttft_s"] > 0 and c["itl_bound_s"] > 0 for c in r["contexts"])
    whole, capped, paced = r["neighbour"]
    assert whole["pairs"] is None and capped["pairs"] == paced["pairs"] == 64 * 64
    assert capped["slowdown"] is None and paced["slowdown"] == 2.0 and paced["mean_of_idle"] > 0
    # capped, the 320-token prompt takes more, smaller chunks beside the short request's decodes
    assert capped["itl_during_prefill_s"]["n"] > whole["itl_during_prefill_s"]["n"] >= 1
    assert paced["itl_during_prefill_s"]["n"] >= capped["itl_during_prefill_s"]["n"]  # decode-only turns too
    assert len(r["users"]["ttft_s"]) == 2 and r["users"]["itl_s"]["n"] > 0
    table = (tmp_path / "results.md").read_text()
    assert "| 320 |" in table and "max_prefill_pairs 4,096" in table and "2 users at 128 tokens" in table
    assert "max_prefill_pairs 4,096, decode_slowdown 2 |" in table
    assert (tmp_path / "long_context.png").stat().st_size > 10_000
    assert "4 decode steps at 320 tokens" in (tmp_path / "profile_decode_320.txt").read_text()


def test_long_needle_benchmark_smoke(tmp_path):
    """bench.long_needle in a CPU smoke shape on the trained small real Inkling: past its window (128) and
    relative extent (256), the float32 engine's tokens equal transformers' fed in chunks, and the table says
    so; the reference stays off above --reference_max."""
    pytest.importorskip("transformers")
    from bench.long_needle import main as long_needle

    argv = ["--device", "cpu", "--lengths", "300,700", "--depths", "0.5", "--chunk", "128",
            "--reference_chunk", "96", "--reference_max", "400", "--out", str(tmp_path)]  # fmt: skip
    assert long_needle(argv) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["results"]
    assert [r["tokens"] < 400 for r in rows] == [True, False]
    assert rows[0]["equal"] and len(rows[0]["engine_tokens"]) == 8 and "equal" not in rows[1]
    table = (tmp_path / "results.md").read_text()
    assert "| 0.5 |" in table and "not run" in table


def test_sampler_benchmark_smoke(tmp_path):
    """bench.sampler checks both ways' tokens and probabilities equal before it times them."""
    from bench.sampler import main as sampler_main

    assert (
        sampler_main(["--device", "cpu", "--batches", "1,3", "--repeats", "1", "--out", str(tmp_path)]) == 0
    )
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 3] and all(r["decode_batched_ms"] > 0 for r in rows)
