"""`make bench` in its CPU smoke shape: the whole script runs and writes its table."""

import json

from bench.e2e import main


def test_e2e_benchmark_smoke(tmp_path):
    argv = ["--preset", "inkling-tiny", "--device", "cpu", "--prompt_len", "96", "--output_len", "4",
            "--batches", "1,2", "--reference_tokens", "1", "--out", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    r = json.loads((tmp_path / "results.json").read_text())
    assert set(r["ttft_s"]) == {"low", "mixed", "high"} and set(r["decode"]) == {"1", "2"}
    assert all(d["throughput_tokens_per_s"] > 0 for d in r["decode"].values())
    assert "time to first token" in (tmp_path / "results.md").read_text()
