#!/bin/bash
# The GPU host's checks and benchmarks, each sized for one device call of at most ten minutes.
#
#     bash bench/gpu_session.sh engine-tests  # 1 GPU: the engine's GPU tests (tests/gpu, the gpu-marked unit
#                                             #   tests; carry [".whl"])
#     bash bench/gpu_session.sh kernel-tests  # 1 GPU: the kernels' GPU tests (attention, MoE, sconv)
#     bash bench/gpu_session.sh bench-decode  # 1 GPU: make bench's first part (TTFT, decode batches 1..64);
#     bash bench/gpu_session.sh bench-mtp     #   then its MTP part and the reference peers; merge on the CPU:
#     bash bench/gpu_session.sh bench-peers   #   python -m bench.e2e --merge --out DIR
#     bash bench/gpu_session.sh profile       # 1 GPU: a profile of the batch-1 decode step by kernel
#     bash bench/gpu_session.sh attention     # 1 GPU: bench.bank_attention on the real shapes, peers included
#     bash bench/gpu_session.sh attention-variants  # 1 GPU: the attention kernel's GPU tests, then the prefill
#                                             #   tiles and a minimal flash kernel timed (bench.bank_attention --variants)
#     bash bench/gpu_session.sh attention-check  # 1 GPU: the attention kernel's GPU tests, the CUDA engine against
#                                             #   transformers, the launcher's prefill tiles timed (carry [".whl"])
#     bash bench/gpu_session.sh checks        # 1 GPU: the attention kernels' GPU tests (Gluon's too), the CUDA engine
#                                             #   against transformers, the Gluon variants timed (carry [".whl"])
#     bash bench/gpu_session.sh gluon         # 1 GPU: the Gluon attention launches' GPU tests, then every
#                                             #   Gluon variant timed beside the launcher's and SDPA
#     bash bench/gpu_session.sh moe           # 1 GPU: the MoE launcher's GPU tests, then bench/moe.py on the real
#                                             #   layer (tuning, bound, bf16 peer)
#     bash bench/gpu_session.sh moe-decode    # 1 GPU: the decode kernels' GPU tests, their variants timed, the tuned op
#                                             #   at T = 1, 8, 64 launch by launch
#     bash bench/gpu_session.sh plugins       # 1 GPU: the CUDA engine against transformers, then the attention,
#                                             #   sconv and sigmoid MoE kernels' GPU tests (carry [".whl"])
#     bash bench/gpu_session.sh serving       # 1 GPU: Triton and the OpenAI API against in-process on the real
#                                             #   Inkling's tiny engine; needs .carry/ (bash bench/make_carry.sh on
#                                             #   the CPU, then the call's carry [".carry"])
#     bash bench/gpu_session.sh long-context  # 1 GPU: bench.long_context on inkling-bench (8K..1M, a
#                                             #   neighbour beside a 256K prompt, 4 users at 256K)
#     bash bench/gpu_session.sh long-needle   # 1 GPU: bench.long_needle, the trained small real Inkling at 8K..1M,
#                                             #   engine against transformers fed in chunks (carry [".whl"])
#     bash bench/gpu_session.sh mtp-batches   # 1 GPU: the real depths' MTP rounds at batch 1, 32, 64 (sampled; DRAFTS=0: plain steps),
#                                             #   after the MTP GPU tests, catch-ups included (carry [".whl"])
#     bash bench/gpu_session.sh compile-check  # 1 GPU: the engine built with --compile against transformers, then
#                                             #   the unembedding on unpadded and padded rows timed (carry [".whl"])
#     bash bench/gpu_session.sh sampler       # 1 GPU: bench.sampler, a step's draws row by row against batched
#     bash bench/gpu_session.sh load          # 1 GPU: engine load times in fresh processes (bench.load)
#     bash bench/gpu_session.sh train-published  # 1 GPU: train data/inkling-small-published, the real
#                                             #   architecture (train/published.py; carry [".whl"] as published)
#     bash bench/gpu_session.sh tp            # 2 GPUs: the tensor-parallel tests (NCCL), then bench.tp tp 2
#     bash bench/gpu_session.sh collectives   # 2 GPUs: Lamport reduce-scatter/all-gather against NCCL
#     bash bench/gpu_session.sh real          # 1 GPU: the real Inkling's kernels' GPU tests, its CUDA engine
#                                             #   (graphs) against transformers, a short inkling-bench e2e
#                                             #   (carry [".whl"] as published)
#     bash bench/gpu_session.sh published     # 1 GPU: the real Inkling's CUDA engine against transformers, the
#                                             #   image processor against transformers' (torchvision is there),
#                                             #   the towers eager vs graphed (bench.towers); needs .whl/ with
#                                             #   the transformers 5.23.0 wheel (carry [".whl"])
#
# Logs and results go under $OUT (the device tool brings them back). The GPU host has its own Python
# with torch and Triton: the project runs from this checkout on PYTHONPATH, never from a fresh venv.
# A command that reaches its time limit dumps its stacks (SIGABRT, faulthandler), so a slow compile or a
# hang says where it is. (pytest's faulthandler_timeout, a dump after 60 s in one test, was dropped: the
# dump itself once crashed a run, rc 139, while the main thread was compiling a kernel.)
set -u
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-build/gpu-out}
mkdir -p "$OUT"
PYTEST=(python3 -X faulthandler -m pytest -q -s -p no:cacheprovider)

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
    [ -d /tmp/ck-tiny ] || python3 -m inkling.published.synth --preset inkling-tiny --nvfp4 --out /tmp/ck-tiny >/dev/null
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

published_tiny_engine() {  # published_tiny_engine DIR [builder flags...]: the real Inkling's tiny NVFP4 checkpoint, built for CUDA
    local dir=$1
    shift
    [ -d /tmp/ck-pub ] || python3 -m inkling.published.synth --preset inkling-tiny --nvfp4 --out /tmp/ck-pub >/dev/null
    python3 -m builder --checkpoint_dir /tmp/ck-pub --output_dir "$dir" --device cuda --dtype bfloat16 \
        --force "$@" >"$OUT/build_$(basename "$dir").log" 2>&1
}

serving_bench() {  # serving_bench LIMIT [builder flags...]: bench.serving on the real Inkling's tiny CUDA engine:
    # in-process against Triton and against the OpenAI API (SERVING_ARGS: bench.serving's --requests and
    # --engine-modes, in place of the default below)
    local limit=$1
    shift
    # tritonserver and the stubs' wheels from .carry/ (bench/make_carry.sh: pytriton's server, NumPy 1 for the
    # stubs, tritonclient; the OpenAI front's packages and the openai client in .carry/front)
    mkdir -p /tmp/site && tar xJf .carry/pytriton.tar.xz -C /tmp/site &&
        python3 -m pip install -q --no-deps --no-index --target /tmp/site .carry/tritonclient-*.whl \
            .carry/python_rapidjson-*.whl .carry/front/*.whl >"$OUT/site.log" 2>&1
    published_tiny_engine /tmp/engine-cuda "$@"
    PYTHONPATH=/tmp/site:$PWD PIP_NO_INDEX=1 PIP_FIND_LINKS=$PWD/.carry run serving "$limit" python3 -m bench.serving \
        --engine /tmp/engine-cuda --max-tokens 512 --threads 4 --out "$OUT/serving.md" \
        --server-log "$OUT/tritonserver.log" ${SERVING_ARGS:---requests 1 8 32 --engine-modes process}
}

with_transformers() {  # the transformers wheel carried in .whl/ (the GPU host's own is older), on PYTHONPATH
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/transformers-*.whl >"$OUT/site.log" 2>&1 && export PYTHONPATH=/tmp/site:$PYTHONPATH
}

case "${1:-}" in
real)
    # The real Inkling on its Triton kernels: the kernels' GPU tests, the CUDA engine (graphs) against
    # transformers, then a short e2e of inkling-bench (carry [".whl"] as published)
    with_transformers
    run kernels_real 200 "${PYTEST[@]}" -m gpu tests/kernels/test_bank_attention.py tests/kernels/test_sigmoid_moe.py
    run published_gpu 200 "${PYTEST[@]}" -m gpu tests/gpu/test_published_gpu.py
    run e2e 300 python3 -m bench.e2e --preset inkling-bench --device cuda --cuda_graphs --output_len 128 \
        --batches "${REAL_BATCHES:-1,32}" --decode_budget_s 8 --temperature 1 --tune_max_tokens 64 \
        --profile_batch 1 --out "$OUT/e2e"
    pack real
    ;;
real-kernels)
    # The real Inkling's kernels: the MoE's and the engine's GPU tests, then the attention on the real shapes
    # beside SDPA and FlexAttention (bench/bank_attention.py); carry [".whl"]
    with_transformers
    run moe_real 150 "${PYTEST[@]}" -m gpu tests/kernels/test_sigmoid_moe.py
    run published_gpu 230 "${PYTEST[@]}" -m gpu tests/gpu/test_published_gpu.py
    run bank_attention 240 python3 -m bench.bank_attention --out "$OUT/attn"
    pack real-kernels
    ;;
real-check)
    # The MoE's GPU tests (the bf16 gate's float32 sums among them) and the CUDA engine against transformers,
    # MTP on graphs included, then built with --compile; carry [".whl"]
    with_transformers
    run moe_real 100 "${PYTEST[@]}" -m gpu tests/kernels/test_sigmoid_moe.py
    run published_gpu 240 "${PYTEST[@]}" -m gpu tests/gpu/test_published_gpu.py
    run compiled_gpu 200 "${PYTEST[@]}" -m gpu tests/gpu/test_compiled_gpu.py
    pack real-check
    ;;
real-mtp)
    # inkling-bench with 3 drafts every step on the real MTP depths (graphs), and decode batches to 64
    with_transformers
    run published_gpu 100 "${PYTEST[@]}" -m gpu tests/gpu/test_published_gpu.py -k "nvfp4 or mtp"
    run e2e_mtp 200 python3 -m bench.e2e --preset inkling-bench --device cuda --cuda_graphs --output_len 128 \
        --batches 1,8 --decode_budget_s 8 --temperature 1 --tune_max_tokens 16 --num_draft_tokens 3 \
        --fixed_drafts --out "$OUT/mtp"
    run e2e_batches 270 python3 -m bench.e2e --preset inkling-bench --device cuda --cuda_graphs --output_len 128 \
        --batches 8,64 --decode_budget_s 8 --temperature 1 --tune_max_tokens 64 --out "$OUT/decode"
    pack real-mtp
    ;;
published)
    with_transformers
    run published_gpu 300 "${PYTEST[@]}" -m gpu tests/gpu/test_published_gpu.py
    run processing 120 "${PYTEST[@]}" tests/unit/test_published_processing.py
    run towers 150 python3 -m bench.towers --out "$OUT/towers"
    pack published
    ;;
train-published)
    with_transformers
    run train_published 480 python3 -m train.published --out "$OUT/inkling-small-published" --device cuda \
        --time_budget "${TRAIN_BUDGET:-320}" --force
    run processing 60 "${PYTEST[@]}" tests/unit/test_published_processing.py
    pack train-published
    ;;
engine-tests)
    with_transformers  # carry [".whl"]: the CUDA engine is checked against transformers
    run engine_gpu 560 "${PYTEST[@]}" -m gpu tests/gpu tests/unit
    pack engine-tests
    ;;
kernel-tests)
    run kernels_gpu 560 "${PYTEST[@]}" -m gpu tests/kernels
    pack kernel-tests
    ;;
bench-decode | bench-mtp | bench-peers)
    run "$1" 580 make GPU=1 "$1" BENCH_DIR="$OUT/bench"
    pack "$1"
    ;;
long-context)
    # LONG_ARGS: more flags, e.g. "--attention_plugin gluon" (the Hopper prefill launches), "--phases contexts"
    run long_context 585 python3 -m bench.long_context --out "$OUT/long_context" ${LONG_ARGS:-}
    pack long-context
    ;;
long-needle)
    # NEEDLE_ARGS: more flags, e.g. "--lengths 1048576 --depths 0.5" for the longest prompt alone
    with_transformers
    run long_needle 585 python3 -m bench.long_needle --budget_s 500 ${NEEDLE_ARGS:-} --out "$OUT/long_needle"
    pack long-needle
    ;;
mtp-batches)
    # MTP_BATCHES, PROMPT_LEN (an H100 holds batch 64 whole at 2,048 tokens, not at 8,192), DRAFT_VOCAB,
    # PROFILE_BATCH (the batch whose rounds are profiled by kernel), DRAFTS (3; 0 for plain steps, the
    # rounds' baseline), ADAPTIVE=1 (the draft policy instead of drafts every step: random depths accept
    # nothing, so it measures steps that draft nothing), COMPILE=1 (torch.compile the step program),
    # E2E_LIMIT (seconds); SKIP_TESTS=1 leaves out the published GPU tests. The MoE tiles are tuned to
    # 512 tokens: batch 64's verify of 4 tokens a sequence (256) falls in the bucket tuned at 512
    # (until 2026-12-06 it ran that bucket's default tiles)
    with_transformers
    [ -n "${SKIP_TESTS:-}" ] || run published_gpu 200 "${PYTEST[@]}" -m gpu tests/gpu/test_published_gpu.py -k "mtp or catch_up"
    mtp=(--num_draft_tokens "${DRAFTS:-3}" --fixed_drafts)
    [ -n "${ADAPTIVE:-}" ] && mtp=(--num_draft_tokens "${DRAFTS:-3}")  # the draft policy decides, both sides
    [ "${DRAFTS:-3}" = 0 ] && mtp=()
    run e2e "${E2E_LIMIT:-380}" python3 -m bench.e2e --preset inkling-bench --device cuda --cuda_graphs --output_len 128 \
        --batches "${MTP_BATCHES:-1,32,64}" --prompt_len "${PROMPT_LEN:-8192}" "${mtp[@]}" \
        --profile_batch "${PROFILE_BATCH:-1}" --tune_max_tokens 512 --decode_budget_s 8 --temperature 1 \
        ${DRAFT_VOCAB:+--draft_vocab_size "$DRAFT_VOCAB"} ${COMPILE:+--compile} --out "$OUT/e2e"
    pack mtp-batches
    ;;
compile-check)
    # The gate of --compile as the default: the CUDA engine built with it against transformers (MTP included),
    # then the unembedding's two cuBLAS forms timed at decode and verify sizes (bench.unembed); carry [".whl"]
    with_transformers
    run compiled_gpu 240 "${PYTEST[@]}" -m gpu tests/gpu/test_compiled_gpu.py
    run unembed 120 python3 -m bench.unembed --out "$OUT/unembed"
    pack compile-check
    ;;
sampler)
    run sampler 120 python3 -m bench.sampler --out "$OUT/sampler"
    pack sampler
    ;;
profile)
    run e2e 400 python3 -m bench.e2e --preset inkling-bench --device cuda --cuda_graphs --compile --output_len 64 \
        --batches 1 --decode_budget_s 4 --profile_batch 1 --tune_max_tokens 16 --out "$OUT/e2e"
    pack profile
    ;;
attention)
    run bank_attention 400 python3 -m bench.bank_attention --out "$OUT/attn"
    pack attention
    ;;
attention-check)
    # After a change to the attention kernel or its defaults: its GPU tests, the CUDA engine against
    # transformers (carry [".whl"]), then the launcher's prefill tiles timed beside SDPA and the flash floor
    with_transformers
    run bank_attention_gpu 150 "${PYTEST[@]}" -m gpu tests/kernels/test_bank_attention.py
    run published_gpu 240 "${PYTEST[@]}" -m gpu tests/gpu/test_published_gpu.py
    run variants 150 python3 -m bench.bank_attention --variants --launcher-only --out "$OUT/attn"
    pack attention-check
    ;;
checks)
    # After a change to the attention: its kernels' GPU tests (the Gluon launches' among them), the CUDA
    # engine against transformers (with --attention_plugin gluon too), then the Gluon variants timed beside
    # the launcher's tiles and SDPA in what time is left (rows are logged as they come); carry [".whl"]
    with_transformers
    run bank_attention_gpu 180 "${PYTEST[@]}" -m gpu tests/kernels/test_bank_attention.py
    run published_gpu 260 "${PYTEST[@]}" -m gpu tests/gpu/test_published_gpu.py
    run variants "${VARIANTS_LIMIT:-150}" python3 -m bench.bank_attention --variants --only gluon --out "$OUT/attn"
    pack checks
    ;;
gluon)
    # The Gluon attention launches (plugins/attention/gluon_attention.py): their GPU tests against the `tl`
    # launches and the math, then every Gluon variant timed beside the launcher's tiles and SDPA
    run gluon_gpu 150 "${PYTEST[@]}" -m gpu tests/kernels/test_bank_attention.py -k gluon
    run variants "${VARIANTS_LIMIT:-400}" python3 -m bench.bank_attention --variants --only gluon --out "$OUT/attn"
    pack gluon
    ;;
attention-variants)
    run bank_attention_gpu "${TEST_LIMIT:-150}" "${PYTEST[@]}" -m gpu tests/kernels/test_bank_attention.py
    run variants "${VARIANTS_LIMIT:-400}" python3 -m bench.bank_attention --variants --out "$OUT/attn"
    pack attention-variants
    ;;
moe)
    run moe_gpu 200 "${PYTEST[@]}" -m gpu tests/kernels/test_moe.py
    run moe "${MOE_LIMIT:-380}" python3 bench/moe.py --out "$OUT/moe" ${MOE_ARGS:-}
    pack moe
    ;;
moe-decode)
    # The decode kernels at the real shapes: the decode variants timed (bench/moe.py DECODE_VARIANTS: split
    # reductions, 32-row tiles, prefetched activations), the tuned op at T = 1, 8, 64 launch by launch, then every bd candidate
    # of tune() against the reference, and the overlap and graph tests
    if [ -n "${TILE_TOKENS-1,4,8}" ]; then  # TILE_TOKENS= (empty) skips the batch-1 variants
        run decode_tiles "${TILES_LIMIT:-150}" python3 bench/moe.py --out "$OUT" --decode-tiles "${TILE_TOKENS-1,4,8}"
    fi
    if [ -n "${BATCH_TOKENS:-}" ]; then  # the scale_w tiles for batches beside the earlier forms
        run batch_tiles "${BATCH_LIMIT:-200}" python3 bench/moe.py --out "$OUT" --batch-tiles "$BATCH_TOKENS"
    fi
    if [ -n "${MOE_TOKENS-1,8,64}" ]; then  # MOE_TOKENS= (empty) skips the tuned op
        run moe "${MOE_LIMIT:-180}" python3 bench/moe.py --out "$OUT" --tokens "${MOE_TOKENS-1,8,64}" --skip-sconv
    fi
    run moe_decode_gpu "${TEST_LIMIT:-200}" "${PYTEST[@]}" -m gpu tests/kernels/test_moe.py \
        -k "decode_kernels or overlap or cuda_graph"
    if [ -n "${NCU:-}" ]; then  # Nsight Compute on the bd kernel's two launches at T = 1 (default config)
        run bd_ncu "${NCU_LIMIT:-120}" ncu --clock-control none --kernel-name regex:moe_bd_kernel --launch-count 2 \
            --section SpeedOfLight --section LaunchStats --section Occupancy --section SchedulerStats \
            --section WarpStateStats --section MemoryWorkloadAnalysis python3 bench/moe.py --launch-only 1
    fi
    ;;
moe-fix)
    # The sigmoid MoE's GPU tests (every op argument passed; real-shape layers drawn in their dtype), the bf16
    # table's chunk shear, then the MoE launcher's forms but the slow decode-kernel sweep
    run moe_real "${MOE_LIMIT:-110}" "${PYTEST[@]}" -m gpu tests/kernels/test_sigmoid_moe.py
    run chunk "${CHUNK_LIMIT:-30}" "${PYTEST[@]}" -m gpu tests/kernels/test_attention.py -k chunk_shear
    run moe_forms "${FORMS_LIMIT:-80}" "${PYTEST[@]}" -m gpu tests/kernels/test_moe.py -k "not decode_kernels"
    pack moe-fix
    ;;
plugins)
    with_transformers
    run published_gpu "${PUB_LIMIT:-260}" "${PYTEST[@]}" -m gpu tests/gpu/test_published_gpu.py
    run kernels_gpu "${KERNEL_LIMIT:-340}" "${PYTEST[@]}" -m gpu tests/kernels/test_sigmoid_moe.py \
        tests/kernels/test_sconv.py tests/kernels/test_bank_attention.py tests/kernels/test_attention.py \
        tests/kernels/test_moe_prmt.py
    pack plugins
    ;;
serving)
    serving_bench 480 --tune false  # Triton and the OpenAI API vs in-process on an untuned tiny engine
    ;;
load)
    tiny_engine /tmp/engine-compiled --compile
    run load 300 python3 -m bench.load --engine /tmp/engine-compiled --out "$OUT/load"
    ;;
tp)
    tp_tests_then_bench 150 380
    pack tp
    ;;
collectives)
    run collectives 300 python3 -m bench.collectives --world_size 2 --out "$OUT/collectives"
    ;;
*)
    sed -n '3,20p' "$0"
    exit 2
    ;;
esac
