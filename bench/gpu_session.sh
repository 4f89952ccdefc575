#!/bin/bash
# The GPU host's checks and runs, each sized for one device call of at most ten minutes.
#
#     bash bench/gpu_session.sh graphs      # 1 GPU: CUDA-graph engine tests (bf16), engine vs reference
#     bash bench/gpu_session.sh mtp         # 1 GPU: bench.mtp with CUDA graphs
#     bash bench/gpu_session.sh e2e         # 1 GPU: bench.e2e on inkling-bench with CUDA graphs, batches 1..64
#     bash bench/gpu_session.sh e2e-mtp     # 1 GPU: the same with 3 MTP drafts per step (random heads)
#     bash bench/gpu_session.sh attn-e2e    # 1 GPU: attention/MoE variant tests and times, e2e batches 1 and 64
#     bash bench/gpu_session.sh tp          # 2 GPUs: bench.tp on 2 layers, tensor-parallel tests (NCCL, Lamport)
#     bash bench/gpu_session.sh overlap     # 1 GPU: overlapped steps (engine test, e2e batch 1 on/off, 64)
#     bash bench/gpu_session.sh e2e-overlap # 1 GPU: the same without the engine test
#     bash bench/gpu_session.sh tp-tests    # 2 GPUs: the tensor-parallel tests only
#
# Logs and results go under $OUT (the device tool brings them back). The GPU host has its own Python
# with torch and Triton: the project runs from this checkout on PYTHONPATH, never from a fresh venv.
# Every pytest run dumps its stacks after 60 s in one test (faulthandler), so a slow compile or a hang
# says where it is.
set -u
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-build/gpu-out}
mkdir -p "$OUT"
PYTEST=(python3 -X faulthandler -m pytest -q -s -p no:cacheprovider -o faulthandler_timeout=60)

run() {  # run NAME SECONDS COMMAND...: log to $OUT/NAME.log, record the exit code
    # At the limit the command gets SIGABRT, on which Python's faulthandler dumps every thread's stack
    # into the log (rc 124), then SIGKILL 10 s later.
    local name=$1 limit=$2
    shift 2
    PYTHONFAULTHANDLER=1 timeout -s ABRT -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    echo "rc $?" >>"$OUT/$name.log"
    echo "== $name: $(tail -n 1 "$OUT/$name.log")"
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
    tar czf "$OUT.tgz" -C "$OUT" . && rm -rf "${OUT:?}"/* && mv "$OUT.tgz" "$OUT/attn-e2e.tgz"
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
*)
    echo "usage: bash bench/gpu_session.sh {graphs|mtp|e2e|e2e-mtp|attn-e2e|tp|tp-tests|overlap|e2e-overlap}" >&2
    exit 2
    ;;
esac
