"""build(checkpoint, build_config) -> Engine: a published-layout Inkling checkpoint (BF16 or NVFP4) into
an engine (builder/engine.py).

Phases (each timed in the build log): read and check the checkpoint; resolve each plugin's implementation;
arrange the weights into the kernels' layout (and, with tp_size or ep_size > 1, per rank); tune the MoE
tiles (CUDA); export the step, MTP-depth and tower programs with torch.export, their dynamic dimensions
bounded by the BuildConfig. The engine config records `model_type` (`inkling_mm_model`), the checkpoint's
config.json as `pretrained_config` (and `quantization` its hf_quant_config.json), and `cache_layout`: each
cache's KV heads (full and sliding layers differ).

BF16 and NVFP4 checkpoints both build (the published NVFP4 file keeps its first MoE layer in BF16, so an
engine holds both kinds). The MTP depths a deployment drafts with (the first max_draft_len) are built, in
BF16 even from an NVFP4 checkpoint as the file keeps them, with one head program per attention kind among
them (`mtp_head_full`, `mtp_head_sliding`: the kinds' KV heads differ). A CUDA engine runs the Triton
kernels, its MoE tiles tuned at build. With tp_size or ep_size > 1 the engine holds one weights file per rank
(builder/tensor_parallel.py, builder/expert_parallel.py); the two do not combine yet.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence

import torch

import plugins
from inkling.published.checkpoint import PublishedCheckpoint
from inkling.published.config import InklingConfig
from inkling.published.processing import PreprocessorSettings
from inkling.published.towers import AudioEmbedding, EncoderProgram, VisionTower
from plugins.attention.launcher import gluon_device_misfit

from .compile import compile_into
from .config import BuildConfig, BuildError
from .contracts import HEAD, STEP
from .engine import ENGINE_FORMAT_VERSION, Engine, RankShard
from .expert_parallel import ExpertParallel, rank_shard
from .network import (
    CacheLayout,
    HeadProgram,
    StepProgram,
    conv_channels,
    depth_conv_channels,
    depth_weights,
    engine_tensors,
)
from .profiles import BuildLog, export_dims
from .tensor_parallel import DRAFT_UNEMBED, UNEMBED, TensorParallel

OPS = ("sconv", "kv_cache_write", "bank_attention", "sigmoid_sink_moe")


def resolve_impls(bc: BuildConfig) -> dict[str, str]:
    """Each op's impl from its plugin family's setting: Triton on a CUDA engine by default, and for the
    attention Gluon's prefill launches where the build runs on a Hopper GPU that has them (an H100: 1.1-1.4x
    the `tl` launches, the engine equal to transformers by the same tests)."""
    resolved = bc.plugin_config.resolve(bc.device)
    if (
        bc.plugin_config.attention == "auto"
        and resolved["attention"] == "triton"
        and gluon_device_misfit() is None
    ):
        resolved["attention"] = "gluon"
    if resolved["attention"] == "gluon":
        _check_gluon_device()
    return {
        "sconv": resolved["sconv"],
        "kv_cache_write": "triton" if resolved["attention"] == "gluon" else resolved["attention"],
        "bank_attention": resolved["attention"],
        "sigmoid_sink_moe": resolved["moe"],
    }


def _check_gluon_device() -> None:
    """--attention_plugin gluon builds where the Gluon launches run."""
    why = gluon_device_misfit()
    if why is not None:
        raise BuildError(f"plugin_config.attention=gluon {why}")


def tune_moe(config: InklingConfig, bc: BuildConfig, weights: dict[str, torch.Tensor], log) -> dict | None:
    """The MoE's tiles per token bucket, timed at build on the first NVFP4 MoE layer (the published file's
    first MoE layer is BF16: those layers take the tensor-core GEMM whatever the table says)."""
    from plugins.moe.launcher import sigmoid_sink_moe, tune

    t = config.text
    layers = [i for i in range(t.num_hidden_layers) if not t.is_dense(i)]
    quantized = [i for i in layers if f"model.llm.layers.{i}.mlp.experts.w13_weight.scale" in weights]
    if not quantized:
        return None
    p = f"model.llm.layers.{quantized[0]}.mlp"
    e, sh = f"{p}.experts", f"{p}.shared_experts"
    w = weights
    tensors = (
        w[f"{p}.gate.weight"], w[f"{p}.gate.bias"], w[f"{p}.gate.global_scale"], w[f"{e}.w13_weight"],
        w[f"{e}.w13_weight.scale"], w[f"{e}.w13_weight.scale2"], w[f"{e}.w2_weight"], w[f"{e}.w2_weight.scale"],
        w[f"{e}.w2_weight.scale2"], w[f"{sh}.shared_w13_weight"], w[f"{sh}.shared_w2_weight"],
    )  # fmt: skip

    def make_inputs(T: int) -> tuple:
        x = torch.randn(T, t.hidden_size, device=tensors[0].device, dtype=getattr(torch, bc.dtype))
        return (x, *tensors, t.route_scale, t.num_experts_per_tok)

    return tune(make_inputs, max_tokens=bc.plugin_config.tune_max_tokens, log=log, op=sigmoid_sink_moe)


def head_program_name(layer_type: str) -> str:
    """The head program of the MTP depths of one attention kind."""
    return "mtp_head_" + ("sliding" if layer_type == "hybrid_sliding" else "full")


def num_built_depths(config: InklingConfig, bc: BuildConfig) -> int:
    """The MTP depths an engine holds: drafts never exceed max_draft_len, so deeper ones would hold weights
    and KV that nobody reads."""
    return min(config.mtp.num_layers, bc.max_draft_len)


def cache_layout(config: InklingConfig, num_depths: int = 0, tp_size: int = 1) -> dict:
    """The caches and sconv states of one rank (tp_size > 1: its KV heads and channels; the MTP depths are
    rank 0's, whole)."""
    lay = CacheLayout.of(config)
    t, tp = config.text, TensorParallel(config, tp_size)
    depths = [config.mtp_attention(d) for d in range(num_depths)]
    return {
        "mtp_kv_heads": [a.num_kv_heads for a in depths],
        "mtp_head_dims": [a.head_dim for a in depths],
        "mtp_conv_channels": [depth_conv_channels(config, d) for d in range(num_depths)],
        "group_of_layer": list(lay.group_of_layer),
        "slot_of_layer": list(lay.cache_of_layer),
        "group_windows": [t.sliding_window_size if k == "hybrid_sliding" else 0 for k in lay.group_kinds],
        "pool_size": len(lay.cache_kinds()),
        "cache_kv_heads": [tp.attention_of(k).num_kv_heads for k in lay.cache_kinds()],
        "cache_head_dims": [t.attention_of(k).head_dim for k in lay.cache_kinds()],
        "conv_channels": conv_channels(config, tp_size),
        "conv_dtype": "float32",
        "sconv_kernel_size": t.conv_kernel_size,
        # the step's expert load counters: one int32 [num_experts] per MoE layer (runtime/expert_load.py)
        "moe_layers": [i for i in range(t.num_hidden_layers) if not t.is_dense(i)],
        "num_experts": t.n_routed_experts,
    }


def step_example(
    config: InklingConfig, bc: BuildConfig, device, dtype, num_seqs: int | None = None, q: int | None = None
) -> dict[str, object]:
    """Example inputs for the export: 2 sequences of 3 and 2 new tokens with media rows (sizes > 1 so
    nothing specialises), the last row of each wanted. With num_seqs and q: that many sequences of q new
    tokens each and no media, as a runtime's prefill (q > 1) or decode step (q = 1) would be (the shapes
    `--compile` warms the compiler on)."""
    lay = cache_layout(config, tp_size=bc.tp_size)
    G, MB, bs = len(lay["group_windows"]), bc.max_blocks_per_seq, bc.tokens_per_block
    i32 = dict(dtype=torch.int32, device=device)
    q_lens = [3, 2] if num_seqs is None else [q] * num_seqs
    B, T = len(q_lens), sum(q_lens)
    per_seq = -(-max(q_lens) // bs)  # blocks each sequence needs in each group
    block_tables = torch.zeros(G, B, MB, **i32)
    for b in range(B):
        block_tables[:, b, :per_seq] = torch.arange(b * per_seq, (b + 1) * per_seq, **i32)
    slots = torch.cat([b * per_seq * bs + torch.arange(n) for b, n in enumerate(q_lens)]).to(device)
    cu = torch.tensor([0, *q_lens], **i32).cumsum(0, dtype=torch.int32)
    H = config.text.hidden_size
    S = config.text.conv_kernel_size - 1 + bc.max_draft_len
    media = 3 if num_seqs is None else 1  # the splice's dummy row at T always; media rows for the export
    num_blocks = max(8, B * per_seq)

    def kv(h, d):
        return torch.zeros(num_blocks, bs, h, d, dtype=dtype, device=device)

    return dict(
        input_ids=torch.arange(1, T + 1, device=device),
        mm_embeds=torch.zeros(media, H, dtype=dtype, device=device),
        mm_positions=torch.tensor([1, 2, T][-media:], device=device),
        cu_seqlens_q=cu,
        seq_lens=torch.tensor(q_lens, **i32),
        block_tables=block_tables,
        slot_mappings=slots.repeat(G, 1),
        state_indices=torch.arange(B, **i32),
        logits_indices=(cu[1:] - 1).long(),
        q_bound=torch.zeros(max(q_lens), dtype=torch.int8, device=device),
        key_caches=[kv(h, d) for h, d in zip(lay["cache_kv_heads"], lay["cache_head_dims"])],
        value_caches=[kv(h, d) for h, d in zip(lay["cache_kv_heads"], lay["cache_head_dims"])],
        conv_states=[torch.zeros(bc.max_batch_size, S, C, device=device) for C in lay["conv_channels"]],
        expert_load=[torch.zeros(lay["num_experts"], **i32) for _ in lay["moe_layers"]],
    )


def export_heads(
    config, bc, impls, weights, num_depths, device, dtype
) -> dict[str, torch.export.ExportedProgram]:
    """One head program per attention kind among the built depths, traced with that kind's first depth."""
    step = step_example(config, bc, device, dtype)
    T, H = step["input_ids"].shape[0], config.text.hidden_size
    S = config.text.conv_kernel_size - 1 + bc.max_draft_len
    out = {}
    for d in range(num_depths):
        kind = config.mtp.layer_types[d]
        name = head_program_name(kind)
        if name in out:
            continue
        a = config.mtp_attention(d)
        kv = torch.zeros(8, bc.tokens_per_block, a.num_kv_heads, a.head_dim, dtype=dtype, device=device)
        example = dict(
            weights=depth_weights(weights, d), h_prev=torch.zeros(T, H, dtype=dtype, device=device),
            input_ids=step["input_ids"], mm_embeds=step["mm_embeds"], mm_positions=step["mm_positions"],
            cu_seqlens_q=step["cu_seqlens_q"], seq_lens=step["seq_lens"], block_table=step["block_tables"][0],
            slot_mapping=step["slot_mappings"][0], state_indices=step["state_indices"], q_bound=step["q_bound"],
            key_cache=kv, value_cache=kv.clone(),
            conv_states=[torch.zeros(bc.max_batch_size, S, C, device=device) for C in depth_conv_channels(config, d)],
        )  # fmt: skip
        args = [example[n] for n in HEAD.names]
        with torch.no_grad():
            out[name] = torch.export.export(
                HeadProgram(config, impls, kind), tuple(args),
                dynamic_shapes=HEAD.dynamic_shapes(export_dims(bc), example),
            )  # fmt: skip
    return out


def encoder_layout(config: InklingConfig, bc: BuildConfig) -> dict:
    """The towers' inputs for the runtime's encoder graphs: one output row per row along `dim`."""
    v = config.vision
    return {
        "vision": {"shape": [0, v.temporal_patch_size, v.patch_size, v.patch_size, v.num_channels], "dim": 0,
                   "input": "float", "max_rows": bc.max_input_len},
        "audio": {"shape": [0, config.audio.n_mel_bins], "dim": 0, "input": "long", "max_rows": bc.max_input_len},
    }  # fmt: skip


def export_towers(config, bc, weights, device, dtype) -> dict[str, torch.export.ExportedProgram]:
    """The vision tower and the audio embedding, their weights inside the programs (they are small)."""
    from torch.export import Dim

    v = config.vision
    n = Dim("rows", min=1, max=bc.max_input_len)
    pixels = torch.zeros(
        3, v.temporal_patch_size, v.patch_size, v.patch_size, v.num_channels, dtype=dtype, device=device
    )
    levels = torch.zeros(5, config.audio.n_mel_bins, dtype=torch.long, device=device)
    out = {}
    for name, tower, example in (
        ("vision", VisionTower(config), pixels),
        ("audio", AudioEmbedding(config), levels),
    ):
        prefix = "model.visual." if name == "vision" else "model.audio."
        program = EncoderProgram(tower, {k: w for k, w in weights.items() if k.startswith(prefix)})
        with torch.no_grad():
            out[name] = torch.export.export(program.eval(), (example,), dynamic_shapes=({0: n},))
    return out


def build(
    source: str | os.PathLike,
    build_config: BuildConfig | None = None,
    echo: bool = True,
    draft_vocab: Sequence[int] | None = None,
) -> Engine:
    """Build an engine from a published-layout checkpoint directory (BF16 or NVFP4). draft_vocab: the
    token ids the MTP depths may draft (builder/draft_vocab.py); default every real token."""
    bc = build_config or BuildConfig()
    log = BuildLog(echo)
    with log.phase("read"):
        from inkling.checkpoint import CheckpointError, load_generation_config

        try:
            reader = PublishedCheckpoint(source)
        except CheckpointError as e:
            raise BuildError(str(e)) from e
        tok = os.path.join(os.fspath(source), "tokenizer.json")
        tokenizer_json = open(tok, encoding="utf-8").read() if os.path.exists(tok) else None
        gen = os.path.join(os.fspath(source), "generation_config.json")
        generation_config = load_generation_config(source) if os.path.exists(gen) else None
        kind = "NVFP4" if reader.config.is_quantized else "BF16"
        log(f"checkpoint {os.fspath(source)}: the real Inkling, {kind}, "
            f"{reader.config.text.num_hidden_layers} layers")  # fmt: skip
    with reader:
        return build_from_tensors(
            reader.config, ((n, reader.get(n)) for n in reader.keys()), bc, log,
            has_mtp=not reader.dropped_mtp, tokenizer_json=tokenizer_json, generation_config=generation_config,
            settings=PreprocessorSettings.from_pretrained(source), draft_vocab=draft_vocab,
        )  # fmt: skip


def build_from_tensors(
    config: InklingConfig,
    tensors: Iterable[tuple[str, torch.Tensor]],
    bc: BuildConfig,
    log: BuildLog,
    has_mtp: bool = True,
    tokenizer_json: str | None = None,
    generation_config: dict | None = None,
    settings: PreprocessorSettings | None = None,
    draft_vocab: Sequence[int] | None = None,
) -> Engine:
    """Build from the checkpoint's (name, tensor) pairs in the published layout: a directory's, or tensors
    synthesized in memory on the GPU (inkling.published.synth.iter_tensors; bench/e2e.py) for models larger
    than the disk. has_mtp: the tensors hold the MTP depths the config names. draft_vocab: as
    build."""
    dtype, device = getattr(torch, bc.dtype), torch.device(bc.device)
    num_depths = num_built_depths(config, bc) if has_mtp else 0
    if not has_mtp:
        log("MTP depths: none in the checkpoint (config names them); the engine decodes without drafts")
    elif config.mtp.num_layers:
        log(f"MTP depths: {num_depths} of {config.mtp.num_layers} built (max_draft_len {bc.max_draft_len}), "
            f"kinds {list(config.mtp.layer_types[:num_depths])}")  # fmt: skip
    if draft_vocab is not None:
        from .draft_vocab import checked_draft_vocab

        draft_vocab = checked_draft_vocab(draft_vocab, config.text.unpadded_vocab_size, num_depths > 0)
        log(f"MTP draft vocabulary: {len(draft_vocab)} tokens (each draft pick reads "
            f"{len(draft_vocab) / config.text.unpadded_vocab_size:.1%} of the unembedding)")  # fmt: skip
    settings = settings or PreprocessorSettings()
    impls = resolve_impls(bc)
    for name, impl in impls.items():
        log(f"plugin {name}: {impl}, version {plugins.get(name).version}")
    ep, tp = ExpertParallel(config, bc.ep_size), TensorParallel(config, bc.tp_size)
    if bc.ep_size == 1:
        tp.check_routed_split()
    if bc.tp_size > 1:
        if bc.compile:
            raise BuildError("--compile with tp_size > 1 is not supported yet (it compiles on one process)")
        impls["collectives"] = bc.plugin_config.resolve_collectives(bc.device)
        log(f"tensor parallel: {bc.tp_size} ranks, collectives {impls['collectives']}, per rank {tp.sizes()}")
    if bc.ep_size > 1:
        if bc.compile:
            raise BuildError("--compile with ep_size > 1 is not supported yet (it compiles on one process)")
        impls["collectives"] = bc.plugin_config.resolve_collectives(bc.device)
        shared = "split by tensor parallelism" if bc.tp_size > 1 else "width split"
        log(f"expert parallel: {bc.ep_size} ranks, {ep.experts_per_rank} routed experts each, the shared "
            f"experts' {shared}, collectives {impls['collectives']}")  # fmt: skip
    if bc.dp_size > 1:
        log(f"data-parallel attention: {bc.dp_size} replicas, each with its own requests, caches, MTP depths "
            "and towers, meeting in the expert-parallel MoE")  # fmt: skip
    with log.phase("weights"):
        weights = {n: t.to(device) for n, t in engine_tensors(config, tensors, dtype, num_depths)}
        nbytes = sum(t.numel() * t.element_size() for t in weights.values())
        log(f"weights: {len(weights)} tensors, {nbytes / 1e9:.3f} GB")
        step_weights = {
            n: w for n, w in weights.items() if not n.startswith(("model.visual.", "model.audio.", "mtp."))
        }
        # The other ranks' step weights; rank 0's share, with its MTP depths and towers whole (and, under
        # tensor parallelism, the whole unembedding for their draft picks)
        other_ranks = {
            r: RankShard({n: rank_shard(tp, ep, n, w, r) for n, w in step_weights.items()}, {})
            for r in range(1, bc.world_size)
        }
        if bc.tp_size > 1 and num_depths:
            weights[DRAFT_UNEMBED] = weights[UNEMBED]
        weights = {n: rank_shard(tp, ep, n, w, 0) if n in step_weights else w for n, w in weights.items()}
        step_weights = {n: weights[n] for n in step_weights}
    tuning = {}
    if impls["sigmoid_sink_moe"] == "triton" and bc.plugin_config.tune and bc.device == "cuda":
        with log.phase("tune"):
            table = tune_moe(config, bc, weights, log)
            if table:
                tuning["sigmoid_sink_moe"] = table
    with log.phase("export"):
        example = {"weights": step_weights, **step_example(config, bc, device, dtype)}
        args = [example[name] for name in STEP.names]
        dynamic = STEP.dynamic_shapes(export_dims(bc), example)
        with torch.no_grad():
            moe_tiles = json.dumps(tuning["sigmoid_sink_moe"]) if "sigmoid_sink_moe" in tuning else ""
            step = torch.export.export(
                StepProgram(config, impls, moe_tiles, bc.ep_size, bc.tp_size, bc.dp_size),
                tuple(args),
                dynamic_shapes=dynamic,
            )
        for part in other_ranks.values():  # every rank's step has the same shapes and ops
            part.programs["step"] = step
        towers = {n: w for n, w in weights.items() if n.startswith(("model.visual.", "model.audio."))}
        weights = {n: w for n, w in weights.items() if n not in towers}
        programs = {
            "step": step,
            **export_heads(config, bc, impls, weights, num_depths, device, dtype),
            **export_towers(config, bc, towers, device, dtype),
        }
        log(f"programs: {sorted(programs)}")
        if bc.dp_size > 1:  # each replica drafts and encodes media for its own requests
            own = {n: w for n, w in weights.items() if n not in step_weights}
            for part in other_ranks.values():
                part.weights.update(own)
                part.programs.update(programs)  # the towers' weights are inside theirs
    ops = {
        name: {"impl": impls[name], "version": plugins.get(name).version,
               "weight_layout_version": plugins.get(name).weight_layout_version}
        for name in OPS
    }  # fmt: skip
    engine_config = {
        "version": ENGINE_FORMAT_VERSION,
        "model_type": "inkling_mm_model",
        "pretrained_config": config.to_dict(),
        "build_config": bc.to_dict(),
        "plugin_config": {"impls": impls, "ops": ops, "tuning": tuning},
        "mapping": {
            "world_size": bc.world_size,
            "tp_size": bc.tp_size,
            "ep_size": bc.ep_size,
            "dp_size": bc.dp_size,
            "experts_per_rank": ep.experts_per_rank,
            **(tp.sizes() if bc.tp_size > 1 else {}),
        },
        "quantization": config.quant.to_dict("engine") if config.quant else None,
        "device": bc.device,
        "dtype": bc.dtype,
        "draft_vocab": draft_vocab,
        "cache_layout": cache_layout(config, num_depths, bc.tp_size),
        "encoders": encoder_layout(config, bc),
        "preprocessor": settings.to_dict(),
    }
    engine = Engine(
        engine_config,
        weights,
        programs,
        tokenizer_json,
        generation_config,
        log.lines,
        other_ranks=other_ranks,
    )
    if bc.compile:
        compile_into(engine, lambda n, q: step_example(config, bc, device, dtype, num_seqs=n, q=q), log)
    return engine
