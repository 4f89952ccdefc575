"""build(checkpoint, build_config) -> Engine: weights into the kernels' layout, programs exported.

Phases (each timed in the build log): read and check the checkpoint; resolve each plugin's
implementation; arrange weights (cast, fuse shared experts, pack NVFP4 experts with the MoE plugin's
`pack_weights`) and, with tp_size > 1, shard them per rank (builder/sharding.py); export the step
program and the encoders with torch.export, dynamic dimensions bounded by the BuildConfig.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence

import torch
from torch.export import Dim
from tqdm import tqdm

import plugins
from inkling.config import InklingConfig
from inkling.encoders import HMLP, Audio
from inkling.tensors import PROJS, routed_expert_module

from .compile import compile_into
from .config import BuildConfig, BuildError
from .contracts import HEAD, STEP
from .engine import ENGINE_FORMAT_VERSION, Engine, RankShard
from .network import CacheLayout, StepProgram
from .profiles import BuildLog, export_dims
from .sharding import TensorParallel


def build(
    source: str | os.PathLike | Iterable[tuple[str, torch.Tensor]],
    build_config: BuildConfig | None = None,
    config: InklingConfig | None = None,
    echo: bool = True,
    draft_vocab: Sequence[int] | None = None,
) -> Engine:
    """Build an engine from a checkpoint directory, or from (name, tensor) pairs with their `config`
    (e.g. `inkling.synth.iter_synthetic_tensors` on the GPU, for models too big for disk).

    draft_vocab: token ids the MTP heads may draft (builder/draft_vocab.py); default every token."""
    bc = build_config or BuildConfig()
    if isinstance(source, (str, os.PathLike)):
        from .published_build import build_published, is_published_checkpoint

        if is_published_checkpoint(source):  # the real Inkling (builder/published_build.py)
            return build_published(source, bc, echo, draft_vocab)
    log = BuildLog(echo)
    tokenizer_json = generation_config = None
    with log.phase("read"):
        if isinstance(source, (str, os.PathLike)):
            from inkling.checkpoint import CheckpointReader, load_generation_config

            reader = CheckpointReader(source)
            config = reader.config
            tensors: Iterable[tuple[str, torch.Tensor]] = ((n, reader.get(n)) for n in reader.keys())
            tok = os.path.join(os.fspath(source), "tokenizer.json")
            tokenizer_json = open(tok, encoding="utf-8").read() if os.path.exists(tok) else None
            generation_config = load_generation_config(source)
            log(f"checkpoint {os.fspath(source)}")
        elif config is None:
            raise BuildError("building from tensors in memory needs their config")
        else:
            tensors = source
        if not config.is_quantized:
            raise BuildError(
                "the earlier model's checkpoint has bf16 routed experts: its build takes NVFP4 ones only "
                "(python -m inkling.synth --nvfp4); the real Inkling builds from BF16 or NVFP4"
            )
    if draft_vocab is not None:
        draft_vocab = _draft_vocab(config, bc, tokenizer_json, draft_vocab)
        log(
            f"MTP draft vocabulary: {len(draft_vocab)} tokens (each draft pick reads "
            f"{len(draft_vocab) / config.vocab_size:.1%} of lm_head)"
        )
    if bc.ep_size != 1 or bc.tp_size != 1:
        raise BuildError(
            f"tensor and expert parallelism (tp_size {bc.tp_size}, ep_size {bc.ep_size}) are built for the "
            "real Inkling only"
        )
    tp = TensorParallel(config, bc.tp_size)
    impls = bc.plugin_config.resolve(bc.device)
    for name, impl in impls.items():
        why = "CUDA engine" if impl == "triton" else ("asked for" if bc.device == "cuda" else "CPU engine")
        log(f"plugin {name}: {impl} ({why}), version {plugins.get(name).version}")
    if tp.tp_size > 1:
        if bc.compile:
            raise BuildError("--compile with tp_size > 1 is not supported yet (it compiles on one process)")
        impls["collectives"] = bc.plugin_config.resolve_collectives(bc.device)
        log(f"tensor parallel: {tp.tp_size} ranks, collectives {impls['collectives']}, per rank {tp.sizes()}")
    dtype = getattr(torch, bc.dtype)
    device = torch.device(bc.device)
    with log.phase("weights"):
        weights, encoder_tensors = arrange_weights(config, tensors, dtype, device)
        shards = tp.split(weights)
        for rank, shard in enumerate(shards):
            nbytes = sum(t.numel() * t.element_size() for t in shard.values())
            log(f"rank {rank} weights: {len(shard)} tensors, {nbytes / 1e9:.3f} GB")
    tuning = {}
    if "triton" in impls.values() and bc.plugin_config.tune:
        with log.phase("tune"):
            tuning = tune_plugins(config, bc, impls, shards[0], log)
    with log.phase("export"):
        moe_tiles = json.dumps(tuning["expert_sink_moe"]) if "expert_sink_moe" in tuning else ""
        step_weights = {k: v for k, v in shards[0].items() if not k.startswith("mtp.")}
        # Every rank's step has the same shapes and ops (collectives find their rank at run time), so
        # one export serves all (the heads too).
        step = export_step(config, bc, impls, step_weights, device, dtype, moe_tiles, tp)
        programs = {"step": step}
        if has_heads(config, bc):
            programs["mtp_head"] = export_head(config, bc, impls, shards[0], device, dtype, tp)
        # Every rank runs the step and the heads; the encoders run on rank 0 only.
        rank_programs = {k: v for k, v in programs.items() if k in ("step", "mtp_head")}
        programs.update(export_encoders(config, bc, encoder_tensors, device, dtype))
        log(
            f"programs: rank 0 {sorted(programs)}"
            + (f", other ranks {sorted(rank_programs)}" if tp.tp_size > 1 else "")
        )
    ops = {}
    op_names = [
        "sheared_bias_attention",
        "kv_cache_write",
        "sconv",
        "sconv_kv_write",
        "expert_sink_moe",
        "mtp_draft",
    ]
    if tp.tp_size > 1:
        op_names += ["reduce_scatter", "all_gather"]
    for name in op_names:
        spec = plugins.get(name)
        impl = impls.get(name, impls["sconv"] if "sconv" in name else impls["sheared_bias_attention"])
        if name in ("reduce_scatter", "all_gather"):
            impl = impls["collectives"]
        ops[name] = {
            "impl": impl,
            "version": spec.version,
            "weight_layout_version": spec.weight_layout_version,
        }
    engine_config = {
        "version": ENGINE_FORMAT_VERSION,
        "pretrained_config": config.to_dict(),
        "build_config": bc.to_dict(),
        "plugin_config": {"impls": impls, "ops": ops, "tuning": tuning},
        "mapping": {"world_size": bc.tp_size, "tp_size": bc.tp_size, "ep_size": 1, **tp.sizes()},
        "quantization": config.quantization_config,
        "device": bc.device,
        "dtype": bc.dtype,
        "draft_vocab": draft_vocab,
        "cache_layout": {
            "group_of_layer": list(CacheLayout.of(config).group_of_layer),
            "slot_of_layer": list(CacheLayout.of(config).slot_of_layer),
            "group_windows": list(CacheLayout.of(config).group_windows),
            "pool_size": CacheLayout.of(config).pool_size,
        },
    }
    engine = Engine(
        engine_config, shards[0], programs, tokenizer_json, generation_config, log.lines,
        other_ranks={rank: RankShard(shards[rank], rank_programs) for rank in range(1, tp.tp_size)},
    )  # fmt: skip
    if bc.compile:
        compile_into(engine, lambda n, q: step_example(config, bc, device, dtype, num_seqs=n, q=q), log)
    return engine


def _draft_vocab(
    config: InklingConfig, bc: BuildConfig, tokenizer_json: str | None, ids: Sequence[int]
) -> list[int]:
    from .draft_vocab import checked_draft_vocab

    size = config.vocab_size
    if tokenizer_json is not None:  # padded rows past the tokenizer are never sampled, nor drafted
        from tokenizers import Tokenizer

        size = Tokenizer.from_str(tokenizer_json).get_vocab_size(with_added_tokens=True)
    return checked_draft_vocab(ids, size, has_heads(config, bc))


def arrange_weights(
    config: InklingConfig,
    tensors: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Checkpoint tensors -> the engine's weights (step program) and the encoders' tensors.

    Routed experts are gathered per layer and packed by the MoE plugin once the layer is complete;
    shared experts are fused to w13 [S, 2I, H] and w2 [S, H, I]; MTP heads (`mtp.*`) keep their names
    (the head program's weights; the step program takes the others)."""
    from plugins.moe import pack_weights

    weights: dict[str, torch.Tensor] = {}
    encoders: dict[str, torch.Tensor] = {}
    experts: dict[int, dict[tuple[int, str], dict[str, torch.Tensor]]] = {}
    shared: dict[int, dict[tuple[int, str], torch.Tensor]] = {}
    E, S = config.num_routed_experts, config.num_shared_experts
    for name, tensor in tqdm(tensors, desc="weights", unit="tensor", leave=False, disable=None):
        if name.startswith(("vision.", "audio.")):
            encoders[name] = tensor.to(device=device, dtype=dtype)
            continue
        module = routed_expert_module(name) or routed_expert_module(name.rsplit(".", 1)[0] + ".weight")
        if module is not None:
            layer, expert, proj = _expert_key(module)
            suffix = name[len(module) + 1 :]
            experts.setdefault(layer, {}).setdefault((expert, proj), {})[suffix] = tensor.to(device)
            if _layer_complete(experts[layer], E):
                layer_experts = experts.pop(layer)
                packed = pack_weights(
                    [
                        {f"{proj}.{k}": v for proj in PROJS for k, v in layer_experts[(e, proj)].items()}
                        for e in range(E)
                    ]
                )
                for key, value in packed.items():
                    weights[f"model.layers.{layer}.mlp.experts_packed.{key}"] = value
            continue
        if ".mlp.shared_experts." in name:
            layer = int(name.split(".")[2])
            s, proj = int(name.split(".")[5]), name.split(".")[6]
            shared.setdefault(layer, {})[(s, proj)] = tensor.to(device=device, dtype=dtype)
            if len(shared[layer]) == 3 * S:
                sh = shared.pop(layer)
                p = f"model.layers.{layer}.mlp"
                weights[f"{p}.shared_w13"] = torch.stack(
                    [torch.cat([sh[(s, "gate_proj")], sh[(s, "up_proj")]]) for s in range(S)]
                )
                weights[f"{p}.shared_w2"] = torch.stack([sh[(s, "down_proj")] for s in range(S)])
            continue
        weights[name] = tensor.to(device=device, dtype=dtype)
    if experts or shared:
        raise BuildError(f"incomplete experts in layers {sorted(set(experts) | set(shared))}")
    return weights, encoders


def _expert_key(module: str) -> tuple[int, int, str]:
    parts = module.split(".")
    return int(parts[2]), int(parts[5]), parts[6]


def _layer_complete(layer_experts: dict, num_experts: int) -> bool:
    return len(layer_experts) == 3 * num_experts and all(len(v) == 4 for v in layer_experts.values())


def tune_plugins(config, bc, impls, weights, log) -> dict:
    """Kernel choices made once at build time and stored in the engine (no tuning at load)."""
    out = {}
    if impls["expert_sink_moe"] == "triton":
        from plugins.moe import PACKED_NAMES
        from plugins.moe.launcher import tune

        p = "model.layers.0.mlp"
        w = weights

        def make_inputs(T: int) -> tuple:
            x = torch.randn(
                T,
                config.hidden_size,
                device=w[f"{p}.router.weight"].device,
                dtype=w[f"{p}.router.weight"].dtype,
            )
            packed = [w[f"{p}.experts_packed.{k}"] for k in PACKED_NAMES]
            return (x, w[f"{p}.router.weight"], *packed, w[f"{p}.shared_w13"], w[f"{p}.shared_w2"],
                    config.num_routed_experts, config.num_experts_per_tok)  # fmt: skip

        out["expert_sink_moe"] = tune(make_inputs, max_tokens=bc.plugin_config.tune_max_tokens, log=log)
    return out


def step_example(
    config: InklingConfig,
    bc: BuildConfig,
    device,
    dtype,
    num_blocks: int = 8,
    tp: TensorParallel | None = None,
    num_seqs: int | None = None,
    q: int | None = None,
) -> dict[str, object]:
    """Example inputs of the step program, by argument name. Default (export): 2 sequences of 3 and 2 new
    tokens with media rows (sizes > 1 so nothing specialises), the last row of each wanted. With num_seqs
    and q: that many sequences of q new tokens each and no media, as a runtime's prefill (q > 1) or decode
    step (q = 1) would be. Caches and sconv states of one rank's size under tensor parallelism; q_bound's
    length is the longest sequence's new tokens (docs/interfaces.md "The step program")."""
    tp = tp or TensorParallel(config)
    layout = CacheLayout.of(config)
    MB = bc.max_blocks_per_seq
    S = config.sconv_kernel_size - 1 + bc.max_draft_len
    i32 = dict(dtype=torch.int32, device=device)
    q_lens = [3, 2] if num_seqs is None else [q] * num_seqs
    B, T = len(q_lens), sum(q_lens)
    bs = bc.tokens_per_block
    per_seq = -(-max(q_lens) // bs)  # blocks each sequence needs
    block_tables = torch.zeros(layout.num_groups, B, MB, **i32)
    for b in range(B):
        block_tables[:, b, :per_seq] = torch.arange(b * per_seq, (b + 1) * per_seq, **i32)
    num_blocks = max(num_blocks, B * per_seq)
    slots = torch.cat([b * per_seq * bs + torch.arange(n) for b, n in enumerate(q_lens)]).to(device)
    cu = torch.tensor([0, *q_lens], **i32).cumsum(0, dtype=torch.int32)
    if num_seqs is None:
        mm_embeds = torch.zeros(3, config.hidden_size, dtype=dtype, device=device)
        mm_positions = torch.tensor([1, 2, T], device=device)
    else:
        mm_embeds = torch.zeros(1, config.hidden_size, dtype=dtype, device=device)
        mm_positions = torch.tensor([T], device=device)
    conv = [torch.zeros(bc.max_batch_size, S, C, dtype=dtype, device=device) for C in tp.conv_channels()]
    kv_shape = (num_blocks, bs, tp.num_kv_heads, config.head_dim)
    return dict(
        input_ids=torch.arange(1, T + 1, device=device),
        mm_embeds=mm_embeds,
        mm_positions=mm_positions,
        cu_seqlens_q=cu,
        seq_lens=torch.tensor(q_lens, **i32),
        block_tables=block_tables,
        slot_mappings=slots.repeat(layout.num_groups, 1),
        state_indices=torch.arange(B, **i32),
        logits_indices=(cu[1:] - 1).long(),
        q_bound=torch.zeros(max(q_lens), dtype=torch.int8, device=device),
        key_caches=[torch.zeros(kv_shape, dtype=dtype, device=device) for _ in range(layout.pool_size)],
        value_caches=[torch.zeros(kv_shape, dtype=dtype, device=device) for _ in range(layout.pool_size)],
        conv_states=conv,
    )


def export_step(
    config, bc, impls, weights, device, dtype, moe_tiles: str = "", tp: TensorParallel | None = None
) -> torch.export.ExportedProgram:
    example = {"weights": weights, **step_example(config, bc, device, dtype, tp=tp)}
    args = [example[name] for name in STEP.names]
    dynamic = STEP.dynamic_shapes(export_dims(bc), example)
    module = StepProgram(config, bc, impls, moe_tiles, tp)
    with torch.no_grad():
        return torch.export.export(module, tuple(args), dynamic_shapes=dynamic)


def has_heads(config: InklingConfig, bc: BuildConfig) -> bool:
    """Whether the engine carries the MTP head program: the checkpoint has heads, the build allows
    drafts, and there is a full-attention group for the heads' KV to share (docs/interfaces.md)."""
    return config.num_mtp_heads > 0 and bc.max_draft_len > 0 and CacheLayout.of(config).group_windows[0] == 0


def head_weights(weights: dict[str, torch.Tensor], m: int) -> dict[str, torch.Tensor]:
    """Head m's (1-based) inputs of the head program: its tensors without the prefix, and embed_tokens."""
    prefix = f"mtp.{m - 1}."
    out = {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}
    out["embed_tokens"] = weights["model.embed_tokens.weight"]
    return out


def export_head(
    config, bc, impls, weights, device, dtype, tp: TensorParallel | None = None
) -> torch.export.ExportedProgram:
    """The MTP head program (builder.network.HeadProgram), traced with head 1's weights (a rank's share
    under tensor parallelism)."""
    from .network import HeadProgram

    tp = tp or TensorParallel(config)
    step = step_example(config, bc, device, dtype, tp=tp)
    T = step["input_ids"].shape[0]
    S = config.sconv_kernel_size - 1 + bc.max_draft_len
    conv = [
        torch.zeros(bc.max_batch_size, S, C, dtype=dtype, device=device)
        for C in head_conv_channels(config, tp)
    ]
    example = dict(
        weights=head_weights(weights, 1),
        h_prev=torch.zeros(T, config.hidden_size, dtype=dtype, device=device),
        input_ids=step["input_ids"],
        mm_embeds=step["mm_embeds"],
        mm_positions=step["mm_positions"],
        cu_seqlens_q=step["cu_seqlens_q"],
        seq_lens=step["seq_lens"],
        block_table=step["block_tables"][0],
        slot_mapping=step["slot_mappings"][0],
        state_indices=step["state_indices"],
        q_bound=step["q_bound"],
        key_cache=step["key_caches"][0],
        value_cache=step["value_caches"][0],
        conv_states=conv,
    )
    args = [example[name] for name in HEAD.names]
    module = HeadProgram(config, bc, impls, tp=tp)
    with torch.no_grad():
        return torch.export.export(
            module, tuple(args), dynamic_shapes=HEAD.dynamic_shapes(export_dims(bc), example)
        )


def head_conv_channels(config: InklingConfig, tp: TensorParallel) -> tuple[int, int, int]:
    """Channels of an MTP head's sconv states on one rank: sites k, v (its KV heads), o (its hidden slice)."""
    kv = tp.num_kv_heads * config.head_dim
    return kv, kv, tp.hidden_slice


def export_encoders(config, bc, tensors, device, dtype) -> dict[str, torch.export.ExportedProgram]:
    """The hMLP stem and the dMel embedding, with their (small) weights inside the programs."""
    out = {}
    side = config.vision.max_image_side // 16
    for name, module_cls, example, dims in (
        ("vision", HMLP, torch.zeros(6, 16, 16, 3), {0: Dim("patches", min=1, max=side * side)}),
        ("audio", Audio, torch.zeros(config.audio.num_mels, 8, dtype=torch.long), {1: config.audio.frame_stack * Dim("tokens", min=1, max=bc.max_input_len)}),
    ):  # fmt: skip
        with torch.device("meta"):
            module = module_cls(config)
        for key, value in tensors.items():
            if key.startswith(f"{name}."):
                mod_name, _, attr = key[len(name) + 1 :].rpartition(".")
                mod_name = mod_name.removeprefix("hmlp").lstrip(".")
                module.get_submodule(mod_name)._parameters[attr] = torch.nn.Parameter(
                    value, requires_grad=False
                )
        example = example.to(device=device, dtype=dtype if example.is_floating_point() else example.dtype)
        with torch.no_grad():
            out[name] = torch.export.export(module.eval(), (example,), dynamic_shapes=(dims,))
    return out
