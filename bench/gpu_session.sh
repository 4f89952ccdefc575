#!/bin/bash
# The GPU host's checks and runs, each sized for one device call of at most ten minutes.
#
#     bash bench/gpu_session.sh graphs      # 1 GPU: CUDA-graph engine tests (bf16), engine vs reference
#     bash bench/gpu_session.sh mtp         # 1 GPU: bench.mtp with CUDA graphs
#     bash bench/gpu_session.sh e2e         # 1 GPU: bench.e2e on inkling-bench with CUDA graphs, batches 1..64
#     bash bench/gpu_session.sh e2e-compiled # 1 GPU: the same, compiled (Inductor), batches 1..64, no reference peers
#     bash bench/gpu_session.sh e2e-mtp     # 1 GPU: the same with 3 MTP drafts per step (random heads)
#     bash bench/gpu_session.sh attn-e2e    # 1 GPU: attention/MoE variant tests and times, e2e batches 1 and 64
#                                           #   (this and the last two return one tarball)
#     bash bench/gpu_session.sh tp          # 2 GPUs: bench.tp on 2 layers, tensor-parallel tests (NCCL, Lamport)
#     bash bench/gpu_session.sh overlap     # 1 GPU: overlapped steps (engine test, e2e batch 1 on/off, 64)
#     bash bench/gpu_session.sh e2e-overlap # 1 GPU: the same without the engine test
#     bash bench/gpu_session.sh tp-tests    # 2 GPUs: the tensor-parallel tests only
#     bash bench/gpu_session.sh tp-bench    # 2 GPUs: bench.tp tp 2 with overlapped steps only
#     bash bench/gpu_session.sh x2          # 2 GPUs: tp-tests, then bench.tp tp 2 (Lamport); beside them on
#                                           #   GPU 1: the attention GPU sweeps, the sampling test, bench.load
#     bash bench/gpu_session.sh serving     # 1 GPU: e2e batches 1 and 8 (compiled), then Triton vs in-process
#     bash bench/gpu_session.sh serving-quick # 1 GPU: Triton (engine process, engine thread) vs in-process only
#                                           #   (untuned tiny engine); serving and serving-quick need .carry/
#                                           #   (bash bench/make_carry.sh on the CPU, then the run's carry [".carry"])
#     bash bench/gpu_session.sh mtp-moe     # 1 GPU: bench.mtp, the MoE per-launch times, e2e with MTP at batch 1;
#                                           #   beside them the moved-program test (tp ranks' device move)
#     bash bench/gpu_session.sh tp-moe      # 2 GPUs: tp-tests, then bench.tp tp 2; beside them on GPU 1 (done
#                                           #   before tp 2 needs it) the MoE GEMV GPU tests, bench/moe.py, e2e batch 1
#     bash bench/gpu_session.sh moe-ncu     # 1 GPU: Nsight Compute on the MoE kernels at T = 1 (tensor cores, GEMV)
#                                           #   (needs the .carry/ wheels: bash bench/make_carry.sh, carry [".carry"])
#     bash bench/gpu_session.sh moe-e2e     # 1 GPU: the MoE decode candidates' GPU test at T = 1 and their times,
#                                           #   then e2e-compiled (batches 1..64)
#     bash bench/gpu_session.sh compile     # 1 GPU: e2e batches 1 and 8 as the runtime runs it, then with the step
#                                           #   program torch.compile'd (Inductor fuses the small ops), profiled
#     bash bench/gpu_session.sh s12-kernels # 1 GPU: attention tests + decode bench, MoE overlap test + times
#     bash bench/gpu_session.sh s12-e2e     # 1 GPU: e2e-compiled, batches 1..64
#     bash bench/gpu_session.sh s13-mtp     # 1 GPU: bench.mtp compiled, with a 32768-token draft vocabulary
#     bash bench/gpu_session.sh s13-verify  # 1 GPU: verify attention (GEMV per query row vs band): tests, bench,
#                                           #   then bench.mtp as s13-mtp
#     bash bench/gpu_session.sh s13-verify2 # 1 GPU: verify 6, 8, 9 queries (both forms), bench.mtp
#     bash bench/gpu_session.sh s13-check   # 1 GPU: the verify attention and MTP engine GPU tests
#     bash bench/gpu_session.sh s13-e2e-mtp # 1 GPU: e2e batch 1 with 3 drafts every step, compiled, draft vocab
#     bash bench/gpu_session.sh s14-host    # 1 GPU: CUDA-graph/MTP engine tests, bench.host on the tiny engine
#     bash bench/gpu_session.sh s14-mtp     # 1 GPU: bench.mtp as s13-mtp, then the e2e MTP round (s13-e2e-mtp)
#     bash bench/gpu_session.sh s15-mtp     # 1 GPU: the pick inside the head graphs: CUDA-graph/MTP engine tests,
#                                           #   bench.host, bench.mtp, the e2e MTP round (decode tiles tuned only)
#     bash bench/gpu_session.sh s16-mtp     # 1 GPU: the drafting graphs with holes and picks inside: MTP/CUDA-graph
#                                           #   engine tests, bench.host, the e2e MTP round with and without them
#     bash bench/gpu_session.sh s16-prefill # 1 GPU: the chunked relative table (shear="chunk"): attention GPU tests,
#                                           #   bench.sm90, bench/attention.py prefill 8K (its variants and the
#                                           #   no-relative floor)
#     bash bench/gpu_session.sh s17         # 1 GPU: MoE GPU tests, the e2e prefill with the new NVFP4 decode
#     bash bench/gpu_session.sh s18         # 1 GPU: the register-capped 8-warp MoE tiles per launch, then the e2e prefill
#     bash bench/gpu_session.sh s18-decode  # 1 GPU: moe_bd_kernel with N tiles first: tests, bd candidates at T = 1, 8, e2e
#     bash bench/gpu_session.sh s20-attn    # 1 GPU: every attention GPU test, the 32K sliding prefill re-timed
#     bash bench/gpu_session.sh s21-moe-batch # 1 GPU: moe_bd_kernel at T = 32, 64 (tests, times), e2e batches 32, 64
#     bash bench/gpu_session.sh s23-attn    # 1 GPU: session 22's untested GPU tests (verify 9/16, rel_slice), decode variants
#     bash bench/gpu_session.sh s22-verify  # 1 GPU: verify of 9-16 queries in tiles of 8: GPU tests, bench with peers
#     bash bench/gpu_session.sh s22-e2e32   # 1 GPU: s22-check's e2e batch 32 with room for the tune
#     bash bench/gpu_session.sh s22-check   # 1 GPU: the attention GPU tests (scratch slots), e2e batch 32 (MoE T = 32 bucket)
#     bash bench/gpu_session.sh s21-attn-all # 1 GPU: bench/attention.py over every workload, peers included
#     bash bench/gpu_session.sh bench-decode # 1 GPU: make bench's first part (then bench-mtp, bench-peers; merge
#                                           #   on the CPU: python -m bench.e2e --merge --out DIR)
#     bash bench/gpu_session.sh s19-attn    # 1 GPU: decode attention split to one KV tile a split: tests, bench, e2e
#     bash bench/gpu_session.sh s19-bd      # 1 GPU: moe_bd_kernel's decode variants at T = 1, 4, 8; e2e batches 1 and 8
#     bash bench/gpu_session.sh s19-check   # 1 GPU: session 18's unchecked changes: engine GPU tests, bench.host, MTP round
#     bash bench/gpu_session.sh s19-profile # 1 GPU: a profile of the batch-1 decode step (compiled), prefill untuned
#     bash bench/gpu_session.sh s18-prmt    # 1 GPU: the NVFP4 decode by byte lookups: tests, GEMMs per launch, e2e
#     bash bench/gpu_session.sh s18-batch   # 1 GPU: e2e batches 1-64 with one prompt a user, batch 32 shared, profiled
#     bash bench/gpu_session.sh s17b        # 1 GPU: the NVFP4 prefill decode on words, the combine slot by slot
#     bash bench/gpu_session.sh s17c        # 1 GPU: the rest of the MoE GPU tests, ncu on the prefill GEMMs
#     bash bench/gpu_session.sh s17d        # 1 GPU: moe_gemm_kernel's grid N tiles first: tests, GEMMs per launch, e2e
#     bash bench/gpu_session.sh s17e        # 1 GPU: the e2e decode at batches 1 to 64, compiled
#     bash bench/gpu_session.sh s17-mtp     # 1 GPU: the e2e MTP round with the draft graphs (compiled)
#     bash bench/gpu_session.sh s16b        # 1 GPU: the fix of s16-mtp's failure, the chunked table as prefill default
#     bash bench/gpu_session.sh s16c        # 1 GPU: the MTP engine tests after the fix, the e2e's 8K prefill profiled
#     bash bench/gpu_session.sh s16-moe-prefill # 1 GPU: the MoE GEMMs at a 4096-token bucket over more tiles
#     bash bench/gpu_session.sh s16-e2e-prefill # 1 GPU: bench.e2e batch 1 with a profile of the 8K prefill
#     bash bench/gpu_session.sh moe-decode  # 1 GPU: the MoE decode kernels' GPU tests and times (every tune()
#                                           #   candidate at T = 1 and 8), then e2e batches 1 and 8, compiled
#
# Logs and results go under $OUT (the device tool brings them back). The GPU host has its own Python
# with torch and Triton: the project runs from this checkout on PYTHONPATH, never from a fresh venv.
# A command that reaches its time limit dumps its stacks (SIGABRT, faulthandler), so a slow compile or a
# hang says where it is. (pytest's faulthandler_timeout, a dump after 60 s in one test, was dropped: in
# s16b the dump itself crashed the run, rc 139, while the main thread was compiling a kernel.)
set -u
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-build/gpu-out}
mkdir -p "$OUT"
PYTEST=(python3 -X faulthandler -m pytest -q -s -p no:cacheprovider)
# session 22's e2e sampled batch 32 with the MoE bucket for 17-32 tokens (s22-check, then s22-e2e32 with room)
S22_E2E32=(python3 -m bench.e2e --preset inkling-bench --device cuda --cuda_graphs --compile --output_len 256
    --batches 32 --decode_budget_s 10 --tune_max_tokens 32 --temperature 1 --reference_peers "" --out "$OUT/e2e")

run() {  # run NAME SECONDS COMMAND...: log to $OUT/NAME.log, record the exit code
    # At the limit the command gets SIGABRT, on which Python's faulthandler dumps every thread's stack
    # into the log (rc 124), then SIGKILL 10 s later.
    local name=$1 limit=$2
    shift 2
    PYTHONFAULTHANDLER=1 timeout -s ABRT -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    echo "rc $?" >>"$OUT/$name.log"
    echo "== $name: $(tail -n 1 "$OUT/$name.log")"
}

pack() {  # pack NAME: everything under $OUT as one tarball (the device tool brings back at most 8 files)
    tar czf "$OUT.tgz" -C "$OUT" . && rm -rf "${OUT:?}"/* && mv "$OUT.tgz" "$OUT/$1.tgz"
}

tiny_engine() {  # tiny_engine DIR [builder flags...]: the synthetic NVFP4 tiny checkpoint, built for CUDA
    local dir=$1
    shift
    [ -d /tmp/ck-tiny ] || python3 -m inkling.synth --preset inkling-tiny --nvfp4 --out /tmp/ck-tiny >/dev/null
    python3 -m builder --checkpoint_dir /tmp/ck-tiny --output_dir "$dir" --device cuda --dtype bfloat16 \
        --force "$@" >"$OUT/build_$(basename "$dir").log" 2>&1
}

tp_tests_then_bench() {  # tp_tests_then_bench TESTS_LIMIT BENCH_LIMIT: the tp 2 tests (NCCL), then bench.tp
    # on 2 layers with Lamport collectives, with overlapped tp 2 steps if the tests (overlap's among them) passed
    INKLING_TP_DEVICE=cuda run tp_nccl "$1" "${PYTEST[@]}" tests/e2e/test_tp.py \
        -k "same_tokens or step_graphs or mtp or overlapped"
    local overlap=()
    tail -n 1 "$OUT/tp_nccl.log" | grep -q "^rc 0" && overlap=(--tp_overlap)  # tp 1 overlaps by default
    run bench_tp "$2" python3 -m bench.tp --preset inkling-bench --layers 2 --tp 2 --cuda_graphs \
        --collectives triton --work /tmp/tp --out "$OUT/tp" "${overlap[@]}"
}

serving_bench() {  # serving_bench LIMIT [builder flags...]: bench.serving on a tiny CUDA engine, Triton vs in-process
    # (SERVING_ARGS: bench.serving's --requests and --engine-modes, in place of the default below)
    local limit=$1
    shift
    # tritonserver and the stubs' wheels from .carry/ (bench/make_carry.sh: pytriton's server, NumPy 1 for the stubs, tritonclient)
    mkdir -p /tmp/site && tar xJf .carry/pytriton.tar.xz -C /tmp/site &&
        python3 -m pip install -q --no-deps --no-index --target /tmp/site .carry/tritonclient-*.whl \
            .carry/python_rapidjson-*.whl >"$OUT/site.log" 2>&1
    tiny_engine /tmp/engine-cuda "$@"
    PYTHONPATH=/tmp/site:$PWD PIP_NO_INDEX=1 PIP_FIND_LINKS=$PWD/.carry run serving "$limit" python3 -m bench.serving \
        --engine /tmp/engine-cuda --max-tokens 512 --threads 4 --out "$OUT/serving.md" \
        --server-log "$OUT/tritonserver.log" ${SERVING_ARGS:---requests 1 8 16 32 --engine-modes process thread}
}

case "${1:-}" in
graphs)
    run graphs_test 200 "${PYTEST[@]}" tests/gpu/test_engine_gpu.py -k "cuda_graphs and bfloat16"
    run engine_gpu 200 "${PYTEST[@]}" tests/gpu/test_engine_gpu.py -k "not float32 and not cuda_graphs"
    ;;
mtp)
    run mtp 420 python3 -m bench.mtp --device cuda --cuda_graphs --out "$OUT/mtp"  # 250 s did not suffice
    ;;
e2e)
    run e2e 560 python3 -m bench.e2e --preset inkling-bench --device cuda --cuda_graphs --output_len 1024 \
        --batches 1,8,32,64 --decode_budget_s 40 --profile_batch 1 --reference_peers eager \
        --reference_timeout_s 90 --out "$OUT/e2e"
    ;;
e2e-compiled)
    run e2e 400 python3 -m bench.e2e --preset inkling-bench --device cuda --cuda_graphs --compile --output_len 512 \
        --batches 1,8,32,64 --decode_budget_s 12 --profile_batch 1 --reference_peers "" --out "$OUT/e2e"
    ;;
e2e-mtp)
    run e2e_mtp 500 python3 -m bench.e2e --preset inkling-bench --device cuda --cuda_graphs --num_draft_tokens 3 \
        --output_len 512 --batches 1,8 --decode_budget_s 40 --reference_peers "" --out "$OUT/e2e-mtp"
    ;;
attn-e2e)
    # the attention tile variants (the scratch shear among them) and the MoE decode GEMV on the GPU;
    # the prefill variants' and the MoE's times; then the e2e at batch 1 (with a kernel profile) and
    # 64. Everything comes back as one tarball.
    run attn_test 100 "${PYTEST[@]}" tests/kernels/test_attention.py -k "gpu and (tile_variants or prefill or chunked)"
    run moe_test 60 "${PYTEST[@]}" tests/kernels/test_moe.py -k "gpu_gemv"
    run attn_bench 100 python3 bench/attention.py --only "prefill 8K" --budget-s 75 --out "$OUT/attn"
    run moe_bench 100 python3 bench/moe.py --tokens 1,8 --skip-sconv --out "$OUT/moe"
    run e2e 220 python3 -m bench.e2e --preset inkling-bench --device cuda --cuda_graphs --output_len 1024 \
        --batches 1,64 --decode_budget_s 25 --profile_batch 1 --reference_peers "" --out "$OUT/e2e"
    pack attn-e2e
    ;;
tp-bench)
    # bench.tp alone, tp 2 with overlapped steps (the tests that gate them passed on 2026-11-30)
    run bench_tp 540 python3 -m bench.tp --preset inkling-bench --layers 2 --tp 2 --cuda_graphs \
        --collectives triton --work /tmp/tp --out "$OUT/tp" --tp_overlap
    ;;
tp | tp-tests)
    if [ "$1" = tp ]; then
        run bench_tp 240 python3 -m bench.tp --preset inkling-bench --layers 2 --tp 2 --cuda_graphs \
            --collectives triton --work /tmp/tp --out "$OUT/tp"
    fi
    INKLING_TP_DEVICE=cuda run tp_nccl 150 "${PYTEST[@]}" tests/e2e/test_tp.py \
        -k "same_tokens or step_graphs or mtp or overlapped"
    INKLING_TP_DEVICE=cuda INKLING_TP_COLLECTIVES=triton run tp_lamport 120 "${PYTEST[@]}" tests/e2e/test_tp.py \
        -k "same_tokens"
    ;;
overlap | e2e-overlap)
    # overlapped steps: the CUDA-graph engine test (bf16: graphed, overlapped and eager tokens, ms per
    # step; not with e2e-overlap), then inkling-bench decode at batch 1 (with overlap off too, and a
    # profile) and 64
    if [ "$1" = overlap ]; then
        run graphs_test 170 "${PYTEST[@]}" tests/gpu/test_engine_gpu.py -k "cuda_graphs and bfloat16"
    fi
    run e2e 250 python3 -m bench.e2e --preset inkling-bench --device cuda --cuda_graphs --output_len 512 \
        --batches 1,64 --decode_budget_s 20 --profile_batch 1 --overlap_off_batches 1 --reference_peers "" \
        --out "$OUT/e2e"
    ;;
x2)
    # Correctness runs that need one GPU go beside the tensor-parallel tests, on GPU 1; they are done
    # (about 300 s) before bench.tp's tp 2 run needs GPU 1 (tp 1 runs on GPU 0 alone). bench.load goes
    # last: it times compiles (CPU), with a few tiny-engine steps on GPU 1.
    (
        export CUDA_VISIBLE_DEVICES=1
        run attn_gpu 200 "${PYTEST[@]}" -m gpu tests/kernels/test_attention.py
        run sampling_gpu 100 "${PYTEST[@]}" tests/gpu/test_engine_gpu.py -k sampling_and_logprobs
        tiny_engine /tmp/engine-compiled --compile
        run load 200 python3 -m bench.load --engine /tmp/engine-compiled --out "$OUT/load"
    ) &
    tp_tests_then_bench 150 380
    wait
    pack x2
    ;;
serving)
    run e2e 220 python3 -m bench.e2e --preset inkling-bench --device cuda --cuda_graphs --compile --output_len 512 \
        --batches 1,8 --decode_budget_s 15 --profile_batch 1 --reference_peers "" --out "$OUT/e2e"
    serving_bench 330
    pack serving
    ;;
serving-quick)
    serving_bench 330 --tune false  # Triton vs in-process only, on an untuned tiny engine (about five minutes)
    ;;
mtp-moe)
    run moved 120 "${PYTEST[@]}" tests/gpu/test_engine_gpu.py -k moved_program &
    run mtp 320 python3 -m bench.mtp --device cuda --cuda_graphs --out "$OUT/mtp"
    wait
    run moe 100 python3 bench/moe.py --tokens 1,8 --skip-sconv --out "$OUT/moe"
    run e2e_mtp 150 python3 -m bench.e2e --preset inkling-bench --device cuda --cuda_graphs --num_draft_tokens 3 \
        --output_len 256 --batches 1 --decode_budget_s 20 --reference_peers "" --out "$OUT/e2e-mtp"
    pack mtp-moe
    ;;
tp-moe)
    (
        export CUDA_VISIBLE_DEVICES=1
        run moe_test 60 "${PYTEST[@]}" tests/kernels/test_moe.py -m gpu -k gemv
        run moe 100 python3 bench/moe.py --tokens 1,8 --skip-sconv --out "$OUT/moe"
        run e2e 200 python3 -m bench.e2e --preset inkling-bench --device cuda --cuda_graphs --output_len 512 \
            --batches 1 --decode_budget_s 20 --profile_batch 1 --reference_peers "" --out "$OUT/e2e"
    ) &
    tp_tests_then_bench 170 370
    wait
    pack tp-moe
    ;;
moe-ncu)
    # Where the routed NVFP4 GEMMs lose their bandwidth (15-17% of it at T = 1): throughput, occupancy,
    # warp stalls and memory traffic of each MoE launch, for both decode kernels. Clocks left alone.
    run moe_ncu 300 ncu --clock-control none --kernel-name regex:moe_ --launch-count 32 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
        --section LaunchStats python3 bench/moe.py --launch-only 1
    ;;
moe-decode)
    # Session 8's measurement, repeated for new decode candidates (stack_gu): correctness of every
    # candidate at inkling-bench shapes, their routed GEMMs timed alone, then the e2e with the tuned table.
    run moe_test 160 "${PYTEST[@]}" tests/kernels/test_moe.py -m gpu -k "decode_kernels or cuda_graph or float32"
    run moe_decode 170 python3 bench/moe.py --decode-kernels 1,8 --out "$OUT/moe"
    run e2e 230 python3 -m bench.e2e --preset inkling-bench --device cuda --cuda_graphs --compile --output_len 512 \
        --batches 1,8 --decode_budget_s 15 --profile_batch 1 --reference_peers "" --out "$OUT/e2e"
    pack moe-decode
    ;;
moe-e2e)
    # tune()'s MoE decode candidates on the GPU at batch 1 (their test), their routed GEMMs timed alone,
    # then the e2e-compiled run with the tuned table (batches 1, 8, 32, 64). Session 11 ran it with four
    # more candidates, since dropped (BENCHMARKS.md, MoE section).
    run moe_test 90 "${PYTEST[@]}" tests/kernels/test_moe.py -m gpu -k "decode_kernels_bf16 and 1]"
    run moe_decode 100 python3 bench/moe.py --decode-kernels 1,8 --out "$OUT/moe"
    run e2e 370 python3 -m bench.e2e --preset inkling-bench --device cuda --cuda_graphs --compile --output_len 512 \
        --batches 1,8,32,64 --decode_budget_s 10 --profile_batch 1 --reference_peers "" --out "$OUT/e2e"
    pack moe-e2e
    ;;
s12-kernels)
    # Session 12: the attention decode's relative term as a tensor-core dot fed by the pipeline (all
    # attention GPU tests; the decode workloads, a 4K-window layer among them, with their tile variants)
    # and the MoE's shared experts on a side stream (their GPU test; the op timed serial and overlapped).
    run attn_test 170 "${PYTEST[@]}" tests/kernels/test_attention.py -m gpu
    run moe_test 90 "${PYTEST[@]}" tests/kernels/test_moe.py -m gpu -k "overlap or cuda_graph"
    run attn_bench 190 python3 bench/attention.py --only "decode" --budget-s 150 --out "$OUT/attn"
    run moe_overlap 80 python3 bench/moe.py --overlap 1,8,64 --out "$OUT/moe"
    pack s12-kernels
    ;;
s12-attn)
    # Session 12: the decode's relative term as a dot against the GEMV, both in the GPU test and timed
    # in every decode workload (tile variants of both)
    run attn_test 120 "${PYTEST[@]}" tests/kernels/test_attention.py -m gpu -k "decode"
    run attn_bench 420 python3 bench/attention.py --only "decode" --budget-s 360 --out "$OUT/attn"
    pack s12-attn
    ;;
s12-e2e)
    # Session 12: e2e-compiled (batches 1..64) with the kernels above; tune() now has the overlap candidates.
    run e2e 420 python3 -m bench.e2e --preset inkling-bench --device cuda --cuda_graphs --compile --output_len 512 \
        --batches 1,8,32,64 --decode_budget_s 10 --profile_batch 1 --reference_peers "" --out "$OUT/e2e"
    pack s12-e2e
    ;;
s12-final)
    # Session 12, last: the MoE GPU tests (overlap, 1-row blocks routed without align, the Triton combine),
    # the op timed serial / overlapped, e2e-compiled (batches 1, 8, 32), then MTP with 3 drafts at batch 1
    run moe_test 150 "${PYTEST[@]}" tests/kernels/test_moe.py -m gpu -k "overlap or cuda_graph or float32 or (decode_kernels and 1])"
    run moe_overlap 60 python3 bench/moe.py --overlap 1,8 --out "$OUT/moe"
    run e2e 250 python3 -m bench.e2e --preset inkling-bench --device cuda --cuda_graphs --compile --output_len 512 \
        --batches 1,8,32 --decode_budget_s 8 --profile_batch 1 --reference_peers "" --out "$OUT/e2e"
    run e2e_mtp 200 python3 -m bench.e2e --preset inkling-bench --device cuda --cuda_graphs --num_draft_tokens 3 \
        --output_len 256 --batches 1 --decode_budget_s 15 --reference_peers "" --out "$OUT/e2e-mtp"
    pack s12-final
    ;;
s12-mtp)
    # Session 12: bench.mtp's step components (verify with k drafts, head pass, draft pick) with the
    # session's kernels (session 7's table was the last)
    run mtp 420 python3 -m bench.mtp --device cuda --cuda_graphs --out "$OUT/mtp"
    pack s12-mtp
    ;;
s13-mtp)
    # Session 13: bench.mtp with the head program compiled (as the step) and a draft vocabulary of 32768
    # tokens (the full-vocabulary pick timed beside it)
    run mtp 540 python3 -m bench.mtp --device cuda --cuda_graphs --compile --draft_vocab_size 32768 --profile \
        --out "$OUT/mtp"
    pack s13-mtp
    ;;
s13-verify)
    # Session 13: a verify's relative term as one GEMV per query row (rel_gemv) against the sheared band:
    # the GPU tests, bench.attention's verify workloads with both forms, then bench.mtp (the k=3 verify)
    run attn_test 170 "${PYTEST[@]}" tests/kernels/test_attention.py -m gpu -k "verify"
    run attn_bench 170 python3 bench/attention.py --only "verify" --budget-s 140 --out "$OUT/attn"
    run mtp 220 python3 -m bench.mtp --device cuda --cuda_graphs --compile --draft_vocab_size 32768 --profile \
        --out "$OUT/mtp"
    pack s13-verify
    ;;
s13-verify2)
    # Session 13: verify 6, 8 and 9 queries with both forms of the relative term, then bench.mtp (k=8
    # back on the band)
    run attn_bench 260 python3 bench/attention.py --only "verify 9,verify 8,verify 6" --budget-s 230 --out "$OUT/attn"
    run mtp 220 python3 -m bench.mtp --device cuda --cuda_graphs --compile --draft_vocab_size 32768 --out "$OUT/mtp"
    pack s13-verify2
    ;;
s13-check)
    # Session 13: the GPU tests of what changed (verify attention's GEMV form and its eight warps; MTP on a
    # CUDA engine; CUDA graphs against eager, MTP steps included)
    run attn_test 150 "${PYTEST[@]}" tests/kernels/test_attention.py -m gpu -k "verify"
    run engine_test 300 "${PYTEST[@]}" tests/gpu/test_engine_gpu.py -k "mtp or graphs_match"
    pack s13-check
    ;;
s14-host)
    # Session 14: the staged graph inputs (one pinned copy a call, NumPy-built), the head passes' one copy of
    # ids and indices, the fused sconv rollback: the CUDA-graph and MTP engine tests, then the host's work
    # per step on the tiny CUDA engine (bench.host), then bench.mtp (its head pass against session 13's)
    run engine_test 300 "${PYTEST[@]}" tests/gpu/test_engine_gpu.py -k "mtp or graphs or overlap"
    tiny_engine /tmp/engine-cuda >"$OUT/tiny_build.log" 2>&1
    run host 120 python3 -m bench.host --engine /tmp/engine-cuda --batch 1 8 --drafts 0 3 --out "$OUT/host"
    pack s14-host
    ;;
s14-mtp)
    # Session 14: bench.mtp as s13-mtp (head pass, replay alone), then the e2e MTP round (s13-e2e-mtp)
    run mtp 300 python3 -m bench.mtp --device cuda --cuda_graphs --compile --draft_vocab_size 32768 \
        --out "$OUT/mtp"
    run e2e_mtp 270 python3 -m bench.e2e --preset inkling-bench --device cuda --cuda_graphs --compile \
        --num_draft_tokens 3 --fixed_drafts --draft_vocab_size 32768 --output_len 128 --batches 1 \
        --decode_budget_s 15 --profile_batch 1 --reference_peers "" --out "$OUT/e2e-mtp"
    pack s14-mtp
    ;;
s17)
    # Session 16 (for the next): the MoE GPU tests with the reference dequantizing 16 experts at a time
    # (test_triton_gpu_bf16[1000-dims1] ran out of memory in it), then the e2e with the new NVFP4 decode
    # and tune()'s GEMM 1/GEMM 2 pair (TTFT and its profile: bench.e2e --profile_prefill), then the e2e
    # MTP round with the draft graphs fixed (never measured end to end: s16-mtp's compile hit its limit)
    run moe_test 150 "${PYTEST[@]}" tests/kernels/test_moe.py -m gpu -k "gpu_bf16 or float32_exact"
    run e2e 260 python3 -m bench.e2e --preset inkling-bench --device cuda --cuda_graphs --output_len 64 \
        --batches 1 --decode_budget_s 5 --profile_prefill --reference_peers "" --out "$OUT/e2e"
    pack s17
    ;;
s18)
    # Session 17 (for the next): the register-capped 8-warp tiles (maxnreg 128: two 8-warp programs an SM
    # instead of 8 warps in all; bench.sm90_moe --tile 128,64,64,8,3,128) per launch at T = 4096 beside the
    # others, then the e2e 8K prefill, whose tune() now also times them; the MoE tests of maxnreg configs
    run moe_tiles 200 python3 bench/moe.py --prefill-tiles 4096 --out "$OUT/moe"
    run e2e 250 python3 -m bench.e2e --preset inkling-bench --device cuda --cuda_graphs --output_len 64 \
        --batches 1 --decode_budget_s 5 --profile_prefill --reference_peers "" --out "$OUT/e2e"
    run moe_test 120 "${PYTEST[@]}" tests/kernels/test_moe.py -m gpu -k "gpu_bf16 or maxnreg"
    pack s18
    ;;
s18-decode)
    # Session 17 (for the next): the decode kernel with the grid's N tiles first (moe_bd_kernel N_FIRST, tune()
    # candidates "n_first"), every bd candidate timed at T = 1 and 8, then the e2e decode at batches 1 to 32
    run moe_test 120 "${PYTEST[@]}" tests/kernels/test_moe.py -m gpu -k "decode_kernels"
    run moe_decode 170 python3 bench/moe.py --decode-kernels 1,8 --out "$OUT/moe"
    run e2e 280 python3 -m bench.e2e --preset inkling-bench --device cuda --cuda_graphs --compile --output_len 128 \
        --batches 1,8,32 --decode_budget_s 6 --reference_peers "" --out "$OUT/e2e"
    pack s18-decode
    ;;
s20-attn)
    # Session 19 (for the next): every attention GPU test in one run (the last whole run was s12-kernels,
    # before 34 of today's 53 GPU tests existed), then the 32K sliding prefill with today's chunk form (its
    # figure, 80.1 ms, is from the gather kernel of 2026-11-29)
    run attn_test 420 "${PYTEST[@]}" tests/kernels/test_attention.py -m gpu
    run attn 150 python3 bench/attention.py --only "prefill 32K" --out "$OUT/attn"
    pack s20-attn
    ;;
s21-moe-batch)
    # Session 20 (for the next): moe_bd_kernel as tune() candidates for 16 < T <= 128 (batch 32-64 decode,
    # MTP verifies). Their GPU test at T = 64, the bd candidates' routed GEMMs and op at T = 32 and 64
    # (bench/moe.py --decode-kernels), then the e2e sampled batches 32 and 64 with tune() choosing (the mma
    # tiles' figures: 18.6 / 27.4 ms a step, bench/results/gpu-2026-12-02/s20-sampled/)
    run moe_test 150 "${PYTEST[@]}" tests/kernels/test_moe.py -m gpu -k "decode_kernels_bf16"
    run moe_bd 150 python3 bench/moe.py --decode-kernels 32,64 --out "$OUT/moe"
    run e2e 260 python3 -m bench.e2e --preset inkling-bench --device cuda --cuda_graphs --compile --output_len 256 \
        --batches 32,64 --decode_budget_s 10 --tune_max_tokens 64 --temperature 1 --reference_peers "" --out "$OUT/e2e"
    pack s21-moe-batch
    ;;
s22-check)
    # Session 21 (for the next): its two unchecked changes. The attention kernel's scratch is now one slot
    # per query tile that exists (an 8K prefill beside 31 decodes asked 10 GiB and ended make bench-mtp at
    # batch 32): every attention GPU test. MoE tune() has a bucket for T = 17-32, where moe_bd_kernel ran the
    # op in 2.43 ms against the tensor-core tiles' 2.66: the e2e sampled batch 32 (18.5-18.7 ms a step with
    # T = 64's tiles, bench/results/gpu-2026-12-02/)
    run attn_test 400 "${PYTEST[@]}" tests/kernels/test_attention.py -m gpu
    run e2e 170 "${S22_E2E32[@]}"
    pack s22-check
    ;;
s22-e2e32)
    # Session 22: s22-check's e2e again with room for the longer tune (90 s with the T = 32 bucket; its 170 s ran out)
    run e2e 330 "${S22_E2E32[@]}"
    pack s22-e2e32
    ;;
s23-attn)
    # Session 22 (for the next): the GPU tests session 22 could not run (verify of 9 and 16 queries in two
    # tiles of 8 rows: its s22-verify run stopped at collection; the GEMV forms with rel_slice), then the
    # decode and verify workloads with their variants: rel_slice 8 first (compiled for sm_90 it drops the
    # decode's spills, bench/results/sm90-decode-2026-12-02/), against the defaults of the one-run table
    # (decode B=1 KV 128K 0.210 ms, 62% of the bandwidth; 1M 1.184 ms, 84%); the peers were timed in that run
    run attn_test 200 "${PYTEST[@]}" tests/kernels/test_attention.py -m gpu -k "verify or decode or rel_slice"
    run attn_bench 330 python3 bench/attention.py --only "decode,verify 9,verify 4 KV 8K W" --no-peers --budget-s 300 \
        --out "$OUT/attn"
    pack s23-attn
    ;;
s22-verify)
    # Session 22: a verify of 9-16 queries (MTP with 8 drafts) in two GEMV tiles of 8 rows, not one 16-row
    # band tile (0.287 ms at 9 against 0.105 at 8 in s21-attn-all); the GPU verify tests, then the bench's
    # verify workloads with their peers (the peers now come before the variant search; in s21-attn-all
    # verify 9's child ran out of time in its variants and lost its peers)
    run attn_test 150 "${PYTEST[@]}" tests/kernels/test_attention.py -m gpu -k "verify or matches_spec_bf16"
    run attn_verify 260 python3 bench/attention.py --only verify --budget-s 220 --out "$OUT/attn"
    pack s22-verify
    ;;
s21-attn-all)
    # Session 20 (for the next): issue 7's one run of bench/attention.py over every workload with the
    # current kernels and peers (the table of 2026-11-29 predates them; its rows were re-timed one by one
    # since). One process a workload, each its share of the budget
    run attn_all 580 python3 bench/attention.py --budget-s 520 --out "$OUT/attn"
    pack s21-attn-all
    ;;
bench-decode|bench-mtp|bench-peers)
    # `make bench` (issue 12) part by part, one device call each (each at most ten minutes on one H200); the
    # parts' directories come back under $OUT/bench/PART. Join them on the CPU once all three are in:
    # python -m bench.e2e --merge --out DIR (DIR/decode, DIR/mtp, DIR/peers: the parts' directories)
    run "$1" 580 make GPU=1 "$1" BENCH_DIR="$OUT/bench"
    pack "$1"
    ;;
s19-attn)
    # Session 19: decode attention with one query splits its KV down to one tile a split, four programs an SM
    # (e2e batch 1: every layer took 23 us, a 4K-window layer as long as a full one): the GPU tests of the
    # decode (the engine-sized sweep and the split variants), the bench's batch-1 decode workloads at their
    # split variants, then the e2e batches 1 and 8 profiled (attention per layer against run 16's 23.3 us)
    run attn_test 150 "${PYTEST[@]}" tests/kernels/test_attention.py -m gpu -k "decode or matches_spec_bf16"
    run attn 150 python3 bench/attention.py --only "decode B=1 KV 8K" --out "$OUT/attn"
    run e2e 230 python3 -m bench.e2e --preset inkling-bench --device cuda --cuda_graphs --compile --output_len 64 \
        --batches 1,8 --decode_budget_s 4 --profile_batch 1 --tune_max_tokens 16 --reference_peers "" --out "$OUT/e2e"
    pack s19-attn
    ;;
s19-bd)
    # Session 19: moe_bd_kernel's decode variants (bench/moe.py DECODE_VARIANTS: GEMM 2 in one round of
    # programs, the routed branch on a stream of higher priority) at T = 1, 4 (an MTP verify) and 8, their
    # GPU tests (the new config key's CUDA-graph replays bit for bit), then the e2e batches 1 and 8 with
    # tune() choosing among the new candidates, batch 1 profiled
    run moe_test 120 "${PYTEST[@]}" tests/kernels/test_moe.py -m gpu -k "overlap"
    run moe_tiles 200 python3 bench/moe.py --decode-tiles 1,4,8 --out "$OUT/moe"
    run e2e 230 python3 -m bench.e2e --preset inkling-bench --device cuda --cuda_graphs --compile --output_len 64 \
        --batches 1,8 --decode_budget_s 4 --profile_batch 1 --tune_max_tokens 16 --reference_peers "" --out "$OUT/e2e"
    pack s19-bd
    ;;
s19-check)
    # Session 18 (for the next, first): what session 18 changed and could not check on the GPU. The engine's
    # GPU tests (engine against the reference; MTP and CUDA graphs, where the head graphs now return views
    # of their output rows) with the byte-lookup prefill decode, bench.host (the drafter's NumPy arguments),
    # then the e2e 3-draft MTP round (compiled, draft graphs) against s17-mtp's 8.22 ms
    run engine_test 280 "${PYTEST[@]}" tests/gpu/test_engine_gpu.py -k "mtp or bfloat16"
    tiny_engine /tmp/engine-cuda >"$OUT/tiny_build.log" 2>&1
    run host 60 python3 -m bench.host --engine /tmp/engine-cuda --batch 1 8 --drafts 0 3 --out "$OUT/host"
    run e2e_mtp 200 python3 -m bench.e2e --preset inkling-bench --device cuda --cuda_graphs --compile \
        --num_draft_tokens 3 --fixed_drafts --draft_vocab_size 32768 --output_len 128 --batches 1 \
        --tune_max_tokens 4 --decode_budget_s 10 --profile_batch 1 --reference_peers "" --out "$OUT/e2e-mtp"
    pack s19-check
    ;;
s19-profile)
    # Session 18 (for the next): a fresh profile of the batch-1 decode step as it runs now (compiled, byte-
    # lookup prefill decode, bd at T = 1), for the 80% goal's budget per kernel; the prefill buckets untuned
    run e2e 230 python3 -m bench.e2e --preset inkling-bench --device cuda --cuda_graphs --compile --output_len 64 \
        --batches 1 --decode_budget_s 4 --profile_batch 1 --tune_max_tokens 16 --reference_peers "" --out "$OUT/e2e"
    pack s19-profile
    ;;
s18-prmt)
    # Session 18: moe_gemm_kernel's NVFP4 decode by byte lookups (inline PTX prmt; bench.sm90_moe: GEMM 1's K
    # loop 545 -> 450 SASS instructions, GEMM 2's 321 -> 274): its GPU tests (the tile bit for bit, the op
    # against the reference), the GEMMs per launch with and without it, then the e2e 8K prefill profiled
    # and the decode at batches 1 and 32 (one prompt a user), compiled
    run moe_test 110 "${PYTEST[@]}" tests/kernels/test_moe_prmt.py tests/kernels/test_moe.py -m gpu \
        -k "prmt or (gpu_bf16 and not maxnreg) or float32_exact"
    run moe_tiles 180 python3 bench/moe.py --prefill-tiles 4096 --out "$OUT/moe"
    run e2e 250 python3 -m bench.e2e --preset inkling-bench --device cuda --cuda_graphs --compile --output_len 128 \
        --batches 1,32 --decode_budget_s 5 --profile_prefill --reference_peers "" --out "$OUT/e2e"
    pack s18-prmt
    ;;
s18-batch)
    # Session 18: why batch 32 took ~6 ms a step in some runs and ~10.5 in others (bimodal within run s17-ab
    # run-a), and the batches with one prompt a user (before, the three tier prompts repeated: every third
    # user decoded the same tokens, so the MoE read the experts of three tokens): compiled, batches 1 to 64,
    # a profile at 32; then batch 32 with the shared prompts, profiled
    run e2e 300 python3 -m bench.e2e --preset inkling-bench --device cuda --cuda_graphs --compile --output_len 128 \
        --batches 1,8,32,64 --decode_budget_s 6 --profile_batch 32 --reference_peers "" --out "$OUT/e2e"
    run e2e_shared 200 python3 -m bench.e2e --preset inkling-bench --device cuda --cuda_graphs --compile \
        --output_len 128 --batches 32 --decode_budget_s 6 --profile_batch 32 --shared_prompts --reference_peers "" \
        --out "$OUT/e2e-shared"
    pack s18-batch
    ;;
s17b)
    # Session 17: the NVFP4 prefill decode on uint32 words, two codes at a time (bench.sm90_moe: GEMM 1's K
    # loop 687 -> 545 SASS instructions per thread, GEMM 2's 695 -> 558), and the combine slot by slot in
    # 1024-column programs: the MoE GPU tests, the GEMMs per launch over PREFILL_TILES at T = 4096, then the
    # e2e 8K prefill profiled
    run moe_test 130 "${PYTEST[@]}" tests/kernels/test_moe.py -m gpu
    run moe_tiles 180 python3 bench/moe.py --prefill-tiles 4096 --out "$OUT/moe"
    run e2e 250 python3 -m bench.e2e --preset inkling-bench --device cuda --cuda_graphs --output_len 64 \
        --batches 1 --decode_budget_s 5 --profile_prefill --reference_peers "" --out "$OUT/e2e"
    pack s17b
    ;;
s17c)
    # Session 17, after s17b (whose MoE test run hit its limit compiling the decode kernels' tests): the
    # rest of the MoE GPU tests, then Nsight Compute on the prefill's routed GEMMs (T = 4096, tune()'s
    # tile pair): why 20% fewer instructions in the K loop gave only 3-4%. Clocks left alone.
    run moe_test 220 "${PYTEST[@]}" tests/kernels/test_moe.py -m gpu -k "decode_kernels or overlap or cuda_graph"
    run moe_ncu 200 ncu --clock-control none --kernel-name regex:moe_gemm --launch-skip 2 --launch-count 2 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section LaunchStats \
        python3 bench/moe.py --launch-only 4096
    pack s17c
    ;;
s17d)
    # Session 17, after s17c's profile: moe_gemm_kernel's grid with the N tiles first (GEMM 2 moved 10 GB of
    # DRAM traffic for 3.1 GB of distinct bytes, the blocks' activations re-read for every N tile): MoE GPU
    # tests of the tensor-core kernel, the GEMMs per launch at T = 4096, the e2e 8K prefill profiled
    run moe_test 150 "${PYTEST[@]}" tests/kernels/test_moe.py -m gpu -k "gpu_bf16 or float32_exact or cuda_graph"
    run moe_tiles 180 python3 bench/moe.py --prefill-tiles 4096 --out "$OUT/moe"
    run e2e 250 python3 -m bench.e2e --preset inkling-bench --device cuda --cuda_graphs --output_len 64 \
        --batches 1 --decode_budget_s 5 --profile_prefill --reference_peers "" --out "$OUT/e2e"
    pack s17d
    ;;
s17e)
    # Session 17: the e2e decode at batches 1 to 64 (compiled) after the MoE's prefill changes (the combine
    # slot by slot in 1024-column programs from 64 tokens, moe_gemm_kernel's grid N tiles first)
    run e2e 470 python3 -m bench.e2e --preset inkling-bench --device cuda --cuda_graphs --compile --output_len 128 \
        --batches 1,8,32,64 --decode_budget_s 6 --reference_peers "" --out "$OUT/e2e"
    pack s17e
    ;;
s17-mtp)
    run e2e_mtp 400 python3 -m bench.e2e --preset inkling-bench --device cuda --cuda_graphs --compile \
        --num_draft_tokens 3 --fixed_drafts --draft_vocab_size 32768 --output_len 128 --batches 1 \
        --tune_max_tokens 4 --decode_budget_s 10 --profile_batch 1 --reference_peers "" --out "$OUT/e2e-mtp"
    pack s17-mtp
    ;;
s16b)
    # Session 16, second call: the drafting graphs' fix (head passes without a pick took their ragged
    # arguments to the device before the graph staged them: s16-mtp's engine tests failed on it), the
    # chunked table as the prefill default (bf16 engines), its bf16-table form, and the prefill variants
    run engine_test 280 "${PYTEST[@]}" tests/gpu/test_engine_gpu.py -k "mtp or (graphs and bfloat16)"
    run attn_test 90 "${PYTEST[@]}" tests/kernels/test_attention.py -k "gpu and chunk or bfloat16_relative"
    run attn_bench 150 python3 bench/attention.py --only "prefill 8K" --budget-s 120 --out "$OUT/attn"
    pack s16b
    ;;
s16-mtp)
    # Session 15 (for the next): a drafting pass's graph fills its draft ids and stores its picks (e57b9eb):
    # the engine's GPU tests on it, the host's work, then the e2e MTP round with the draft graphs and with
    # the pick launched apart (--eager_pick), one after the other on one machine
    run engine_test 280 "${PYTEST[@]}" tests/gpu/test_engine_gpu.py -k "mtp or (graphs and bfloat16)"
    tiny_engine /tmp/engine-cuda >"$OUT/tiny_build.log" 2>&1
    run host 60 python3 -m bench.host --engine /tmp/engine-cuda --batch 1 8 --drafts 0 3 --out "$OUT/host"
    for pick in graph eager; do
        flag=()
        [ "$pick" = eager ] && flag=(--eager_pick)
        run "e2e_mtp_$pick" 110 python3 -m bench.e2e --preset inkling-bench --device cuda --cuda_graphs --compile \
            --num_draft_tokens 3 --fixed_drafts --draft_vocab_size 32768 --output_len 128 --batches 1 \
            --tune_max_tokens 4 --decode_budget_s 10 --reference_peers "" "${flag[@]}" --out "$OUT/e2e-mtp-$pick"
    done
    pack s16-mtp
    ;;
s16-prefill)
    # Session 15 (for the next): prefill attention with the relative term per chunk of tiles, so the tile
    # loop has no barrier and is software-pipelined (bench.sm90: 0 cp.async in the scratch form's loop)
    run attn_test 240 "${PYTEST[@]}" tests/kernels/test_attention.py -k "gpu and (chunk or tile_variants or prefill)"
    run sm90 60 python3 -m bench.sm90 --out "$OUT/sm90"
    run attn_bench 220 python3 bench/attention.py --only "prefill 8K" --budget-s 180 --out "$OUT/attn"
    pack s16-prefill
    ;;
s16c)
    # Session 16, third call: the drafting graphs' fix on the GPU, then the e2e's 8K prefill with the
    # chunked table, profiled (MoE tiles tuned for every bucket, as a user's build; no --compile)
    run engine_test 250 "${PYTEST[@]}" tests/gpu/test_engine_gpu.py -k "mtp or (graphs and bfloat16)"
    run e2e 310 python3 -m bench.e2e --preset inkling-bench --device cuda --cuda_graphs --output_len 64 \
        --batches 1 --decode_budget_s 5 --profile_prefill --reference_peers "" --out "$OUT/e2e"
    pack s16c
    ;;
s16-moe-prefill)
    # the MoE GEMMs at a 4096-token prefill bucket over more tiles than tune()'s (bench/moe.py PREFILL_TILES)
    run moe_tiles 300 python3 bench/moe.py --prefill-tiles 4096 --out "$OUT/moe"
    pack s16-moe-prefill
    ;;
s16d)
    # the NVFP4 decode straight from each byte's bits (plugins/moe/kernels.py _e2m1_f16): the MoE GPU tests
    # of the tensor-core kernel, then the GEMMs at a 4096-token bucket over PREFILL_TILES
    run moe_test 110 "${PYTEST[@]}" tests/kernels/test_moe.py -m gpu -k "gpu_bf16 or float32_exact"
    run moe_tiles 150 python3 bench/moe.py --prefill-tiles 4096 --out "$OUT/moe"
    pack s16d
    ;;
s16-e2e-prefill)
    # the e2e with a profile of the 8K prefill (MoE tiles tuned for every bucket, as a user's build)
    run e2e 500 python3 -m bench.e2e --preset inkling-bench --device cuda --cuda_graphs --compile --output_len 64 \
        --batches 1 --decode_budget_s 5 --profile_prefill --reference_peers "" --out "$OUT/e2e"
    pack s16-e2e-prefill
    ;;
s15-mtp)
    # Session 15: a drafting head pass replays one graph for the head and its draft pick (Drafter.head_and_pick)
    run engine_test 260 "${PYTEST[@]}" tests/gpu/test_engine_gpu.py -k "mtp or (graphs and bfloat16)"
    tiny_engine /tmp/engine-cuda >"$OUT/tiny_build.log" 2>&1
    run host 90 python3 -m bench.host --engine /tmp/engine-cuda --batch 1 8 --drafts 0 3 --out "$OUT/host"
    run mtp 240 python3 -m bench.mtp --device cuda --cuda_graphs --compile --draft_vocab_size 32768 \
        --out "$OUT/mtp"
    run e2e_mtp 200 python3 -m bench.e2e --preset inkling-bench --device cuda --cuda_graphs --compile \
        --num_draft_tokens 3 --fixed_drafts --draft_vocab_size 32768 --output_len 128 --batches 1 \
        --tune_max_tokens 16 --decode_budget_s 15 --profile_batch 1 --reference_peers "" --out "$OUT/e2e-mtp"
    pack s15-mtp
    ;;
s13-e2e-mtp)
    # Session 13: the e2e decode at batch 1 with 3 drafts every step (the adaptive policy off: random
    # heads accept nothing), compiled, a 32768-token draft vocabulary: a whole MTP round as the runtime runs it
    run e2e_mtp 360 python3 -m bench.e2e --preset inkling-bench --device cuda --cuda_graphs --compile \
        --num_draft_tokens 3 --fixed_drafts --draft_vocab_size 32768 --output_len 256 --batches 1 \
        --decode_budget_s 15 --profile_batch 1 --reference_peers "" --out "$OUT/e2e-mtp"
    pack s13-e2e-mtp
    ;;
compile)
    run e2e 200 python3 -m bench.e2e --preset inkling-bench --device cuda --cuda_graphs --output_len 512 \
        --batches 1,8 --decode_budget_s 15 --profile_batch 1 --reference_peers "" --out "$OUT/e2e"
    run e2e_compile 370 python3 -m bench.e2e --preset inkling-bench --device cuda --cuda_graphs --compile \
        --output_len 512 --batches 1,8 --decode_budget_s 15 --profile_batch 1 --reference_peers "" \
        --out "$OUT/e2e-compile"
    pack compile
    ;;
*)
    echo "usage: bash bench/gpu_session.sh {graphs|mtp|e2e|e2e-mtp|attn-e2e|tp|tp-tests|tp-bench|overlap|e2e-overlap|x2|serving|mtp-moe|tp-moe|moe-ncu|moe-decode|compile|e2e-compiled|serving-quick|moe-e2e|s12-kernels|s12-attn|s12-e2e|s12-final|s12-mtp|s13-mtp|s13-verify|s13-verify2|s13-check|s13-e2e-mtp|s14-host|s14-mtp}" >&2
    exit 2
    ;;
esac
