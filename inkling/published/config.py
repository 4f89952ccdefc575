"""The real Inkling's configuration (INKLING_SPEC.md §1), read as the published files spell it.

    config = InklingConfig.from_pretrained(path)        # config.json (+ hf_quant_config.json if there)
    config.text.attention(5)                            # the shape of layer 5's attention
    config = preset("inkling-tiny")                     # our presets (INKLING_SPEC "Presets")

Two spellings of config.json are read: the published one (`dense_mlp_idx`, `dense_intermediate_size`
with `intermediate_size` as the *expert* width, `model_max_length`, `sconv_kernel_size`, a top-level
`mtp_config`) and the one transformers' `save_pretrained` writes (`mlp_layer_types`,
`moe_intermediate_size`, `max_position_embeddings`, `conv_kernel_size`, `num_mtp_layers` in the text
config). Both derive the fields as transformers 5.23.0 does, in its order. `to_dict` writes the
published spelling. Every dataclass is frozen and validated: an invalid config cannot exist, and a bad
file gets an error that names the file and the field.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
from dataclasses import dataclass, field
from typing import Any

from .tokens import tiny_token_ids

MODEL_TYPE = "inkling_mm_model"
FULL = "hybrid"
SLIDING = "hybrid_sliding"
DENSE = "dense"
SPARSE = "sparse"
CONFIG_FILE = "config.json"
QUANT_CONFIG_FILE = "hf_quant_config.json"

# Checkpoint keys that transformers keeps but never reads: its code hard-wires each one's value, so a
# checkpoint that says otherwise describes a model nobody implements (INKLING_SPEC §1.2).
_HARD_WIRED = {
    "use_sconv": True,
    "use_embed_norm": True,
    "use_gate_bias": True,
    "use_global_scale": True,
    "norm_after_topk": True,
    "shared_expert_sink": True,
    "gate_activation": "sigmoid",
    "hidden_act": "silu",
    "q_bias": False,
    "o_bias": False,
    "final_logit_softcapping": None,
}
# (checkpoint spelling, stored name): transformers' attribute maps (INKLING_SPEC §1.3)
_TEXT_ALIASES = (
    ("sconv_kernel_size", "conv_kernel_size"),
    ("model_max_length", "max_position_embeddings"),
    ("sliding_window", "sliding_window_size"),
    ("num_local_experts", "n_routed_experts"),
    ("embedding_multiplier", "logits_mup_width_multiplier"),
)


class ConfigError(ValueError):
    """A config file that does not describe a valid Inkling model; the message names the file and field."""


def _require(cond: bool, where: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{where}: {msg}")


def _int_tuple(value: Any, where: str, name: str) -> tuple[int, ...]:
    ok = isinstance(value, (list, tuple)) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    )
    _require(ok, where, f"{name} must be a list of integers, got {value!r}")
    return tuple(value)


@dataclass(frozen=True)
class AttentionShape:
    """One attention layer's shape: heads, window (None: full attention), relative extent, log scaling."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    window: int | None
    rel_extent: int
    d_rel: int
    log_scaling_n_floor: int | None  # None: no log scaling (sliding layers, or disabled)
    log_scaling_alpha: float

    @property
    def is_sliding(self) -> bool:
        return self.window is not None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def r_size(self) -> int:
        return self.num_heads * self.d_rel


@dataclass(frozen=True)
class TextConfig:
    """The language model (INKLING_SPEC §1.2), under transformers' stored names; derived fields filled."""

    vocab_size: int = 201024
    unpadded_vocab_size: int | None = None  # None: the vocabulary is not padded
    hidden_size: int = 6144
    num_hidden_layers: int = 66
    num_attention_heads: int = 64
    num_key_value_heads: int = 8
    head_dim: int = 128
    swa_num_attention_heads: int = 64
    swa_num_key_value_heads: int = 16
    swa_head_dim: int = 128
    sliding_window_size: int = 512
    d_rel: int = 16
    rel_extent: int = 1024
    log_scaling_n_floor: int | None = None
    log_scaling_alpha: float = 0.1
    layer_types: tuple[str, ...] = ()
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-6
    conv_kernel_size: int = 4
    mlp_layer_types: tuple[str, ...] = ()
    intermediate_size: int = 24576  # the dense MLP's width (transformers' meaning)
    moe_intermediate_size: int = 3072  # routed and shared experts' width
    n_routed_experts: int = 256
    num_experts_per_tok: int = 6
    n_shared_experts: int = 2
    route_scale: float = 8.0
    logits_mup_width_multiplier: float = 24.0
    where: str = field(default="text_config", compare=False, repr=False)

    def __post_init__(self) -> None:
        w = self.where
        if not self.layer_types:
            object.__setattr__(self, "layer_types", default_layer_types(self.num_hidden_layers))
        if not self.mlp_layer_types:
            object.__setattr__(self, "mlp_layer_types", (SPARSE,) * self.num_hidden_layers)
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "mlp_layer_types", tuple(self.mlp_layer_types))
        positive = (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "swa_num_attention_heads", "swa_num_key_value_heads", "swa_head_dim",
            "sliding_window_size", "d_rel", "rel_extent", "max_position_embeddings", "conv_kernel_size",
            "intermediate_size", "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok",
        )  # fmt: skip
        for name in positive:
            v = getattr(self, name)
            _require(
                isinstance(v, int) and not isinstance(v, bool) and v > 0,
                w,
                f"{name} must be a positive integer, got {v!r}",
            )
        for name in ("rms_norm_eps", "route_scale", "logits_mup_width_multiplier", "log_scaling_alpha"):
            v = getattr(self, name)
            _require(isinstance(v, (int, float)) and v > 0, w, f"{name} must be a positive number, got {v!r}")
        _require(self.n_shared_experts >= 0, w, f"n_shared_experts must be >= 0, got {self.n_shared_experts}")
        u = self.unpadded_vocab_size
        _require(
            u is None or 0 < u <= self.vocab_size,
            w,
            f"unpadded_vocab_size {u} must lie in (0, vocab_size {self.vocab_size}]",
        )
        n = self.log_scaling_n_floor
        _require(n is None or n > 0, w, f"log_scaling_n_floor must be positive or null, got {n!r}")
        for kind, heads, kv in (("", self.num_attention_heads, self.num_key_value_heads),
                                ("swa_", self.swa_num_attention_heads, self.swa_num_key_value_heads)):  # fmt: skip
            _require(
                heads % kv == 0,
                w,
                f"{kind}num_attention_heads ({heads}) is not a multiple of {kind}num_key_value_heads ({kv})",
            )
        _require(
            self.num_experts_per_tok <= self.n_routed_experts, w,
            f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds n_routed_experts ({self.n_routed_experts})",
        )  # fmt: skip
        L = self.num_hidden_layers
        for name, allowed in (("layer_types", (FULL, SLIDING)), ("mlp_layer_types", (DENSE, SPARSE))):
            values = getattr(self, name)
            _require(len(values) == L, w, f"{name} has {len(values)} entries for {L} layers")
            bad = sorted({t for t in values if t not in allowed})
            _require(not bad, w, f"{name} has unknown values {bad}; expected {list(allowed)}")

    @property
    def num_real_tokens(self) -> int:
        """Columns of the logits: the unpadded vocabulary (INKLING_SPEC §3.7)."""
        return self.unpadded_vocab_size or self.vocab_size

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING

    def is_dense(self, layer: int) -> bool:
        return self.mlp_layer_types[layer] == DENSE

    def attention_of(self, layer_type: str) -> AttentionShape:
        if layer_type == SLIDING:  # the window is also the relative extent; no log scaling
            return AttentionShape(
                self.swa_num_attention_heads, self.swa_num_key_value_heads, self.swa_head_dim,
                self.sliding_window_size, self.sliding_window_size, self.d_rel, None, self.log_scaling_alpha,
            )  # fmt: skip
        return AttentionShape(
            self.num_attention_heads, self.num_key_value_heads, self.head_dim, None, self.rel_extent,
            self.d_rel, self.log_scaling_n_floor, self.log_scaling_alpha,
        )  # fmt: skip

    def attention(self, layer: int) -> AttentionShape:
        return self.attention_of(self.layer_types[layer])


def default_layer_types(num_layers: int, local_layer_ids: tuple[int, ...] | None = None) -> tuple[str, ...]:
    """Sliding iff in `local_layer_ids`; without them, iff (i + 1) % 6 != 0 (INKLING_SPEC §1.4)."""
    local = (
        set(local_layer_ids) if local_layer_ids is not None else {i for i in range(num_layers) if (i + 1) % 6}
    )
    return tuple(SLIDING if i in local else FULL for i in range(num_layers))


@dataclass(frozen=True)
class VisionConfig:
    """The hMLP tower (INKLING_SPEC §1.5, §4). n_layers 1..5: from 6 on its scale plan cannot be built."""

    patch_size: int = 40
    temporal_patch_size: int = 2
    num_channels: int = 3
    n_layers: int = 4

    def __post_init__(self) -> None:
        w = "vision_config"
        _require(self.patch_size > 0, w, f"patch_size must be positive, got {self.patch_size}")
        _require(
            self.temporal_patch_size > 0,
            w,
            f"temporal_patch_size must be positive, got {self.temporal_patch_size}",
        )
        _require(self.num_channels == 3, w, f"num_channels must be 3 (RGB), got {self.num_channels}")
        _require(
            1 <= self.n_layers <= 5, w,
            f"n_layers must lie in 1..5 (from 6 on the scale plan repeats a 614400-wide scale), got {self.n_layers}",
        )  # fmt: skip


@dataclass(frozen=True)
class AudioConfig:
    """The dMel embedder (INKLING_SPEC §1.6, §5): mel_vocab_size levels per mel channel."""

    n_mel_bins: int = 80
    mel_vocab_size: int = 256

    def __post_init__(self) -> None:
        for name in ("n_mel_bins", "mel_vocab_size"):
            _require(
                getattr(self, name) > 0, "audio_config", f"{name} must be positive, got {getattr(self, name)}"
            )


@dataclass(frozen=True)
class MTPConfig:
    """The MTP depths (INKLING_SERVING.md §1.1): transformers reads only these facts and defines no MTP."""

    num_layers: int = 0
    local_layer_ids: tuple[int, ...] | None = None  # None: every depth is full attention
    chain_hidden_post_norm: bool = False
    # Where the public engines disagree (INKLING_SERVING §1.7), the majority's choice by default; neither
    # key is in the published config, an engine's mtp_config may set them:
    # - log_scaling: the trunk's τ(i) inside full-attention depths (SGLang); vLLM and TokenSpeed apply none.
    # - target_hidden_pre_norm: depth 0 reads the trunk's last hidden state before the final norm (OMLX);
    #   vLLM, SGLang and TokenSpeed feed it after the norm.
    log_scaling: bool = False
    target_hidden_pre_norm: bool = False

    def __post_init__(self) -> None:
        _require(
            self.num_layers >= 0,
            "mtp_config",
            f"num_nextn_predict_layers must be >= 0, got {self.num_layers}",
        )
        bad = [d for d in self.local_layer_ids or () if not 0 <= d < self.num_layers]
        _require(not bad, "mtp_config", f"local_layer_ids {bad} lie outside the {self.num_layers} depths")

    @property
    def layer_types(self) -> tuple[str, ...]:
        local = set(self.local_layer_ids or ())
        return tuple(SLIDING if d in local else FULL for d in range(self.num_layers))


@dataclass(frozen=True)
class QuantConfig:
    """hf_quant_config.json of an NVFP4 checkpoint (INKLING_SERVING.md §2.1): ModelOpt's nested form."""

    quant_algo: str = "NVFP4"
    group_size: int = 16
    exclude_modules: tuple[str, ...] = ()
    kv_cache_quant_algo: str | None = None

    def __post_init__(self) -> None:
        w = QUANT_CONFIG_FILE
        _require(
            self.quant_algo == "NVFP4", w, f"quantization.quant_algo must be 'NVFP4', got {self.quant_algo!r}"
        )
        _require(self.group_size == 16, w, f"quantization.group_size must be 16, got {self.group_size!r}")
        _require(
            self.kv_cache_quant_algo in (None, "none", "NONE"), w,
            f"quantization.kv_cache_quant_algo {self.kv_cache_quant_algo!r} is not supported (the KV cache stays bf16)",
        )  # fmt: skip

    def is_excluded(self, module: str) -> bool:
        """Whether `module` (e.g. `model.llm.layers.2.mlp.experts`) stays unquantized: it or a parent is
        listed, or it matches a listed pattern."""
        return any(
            module == p or module.startswith(p + ".") or fnmatch.fnmatchcase(module, p)
            for p in self.exclude_modules
        )

    @classmethod
    def from_dict(cls, d: Any, where: str = QUANT_CONFIG_FILE) -> QuantConfig:
        _require(isinstance(d, dict), where, f"must be a JSON object, got {type(d).__name__}")
        q = d.get("quantization")
        _require(isinstance(q, dict), where, "has no 'quantization' object (ModelOpt's nested form)")
        for key in ("quant_algo", "group_size"):
            _require(key in q, where, f"quantization.{key} is missing")
        excl = q.get("exclude_modules") or []
        _require(isinstance(excl, list) and all(isinstance(e, str) for e in excl), where,
                 f"quantization.exclude_modules must be a list of module names, got {excl!r}")  # fmt: skip
        cfg = (q.get("modelopt_quant_config") or {}).get("quant_cfg", {})
        for quantizer in ("*weight_quantizer", "*input_quantizer"):
            if quantizer in cfg:
                qc = cfg[quantizer]
                bits = list(qc.get("num_bits") or [])
                scale_bits = list((qc.get("block_sizes") or {}).get("scale_bits") or [])
                _require(bits == [2, 1] and scale_bits == [4, 3], where,
                         f"quant_cfg[{quantizer!r}] is not NVFP4 (num_bits {bits}, scale_bits {scale_bits}; "
                         "expected [2, 1] and [4, 3])")  # fmt: skip
        try:
            return cls(q["quant_algo"], q["group_size"], tuple(excl), q.get("kv_cache_quant_algo"))
        except ConfigError as e:
            raise ConfigError(str(e).replace(QUANT_CONFIG_FILE, where, 1)) from None

    def to_dict(self, modelopt_version: str) -> dict[str, Any]:
        quantizer = {"num_bits": [2, 1], "block_sizes": {"-1": 16, "type": "dynamic", "scale_bits": [4, 3]},
                     "axis": None, "enable": True}  # fmt: skip
        return {
            "producer": {"name": "modelopt", "version": modelopt_version},
            "quantization": {
                "quant_algo": self.quant_algo,
                "kv_cache_quant_algo": self.kv_cache_quant_algo,
                "group_size": self.group_size,
                "exclude_modules": list(self.exclude_modules),
                "modelopt_quant_config": {
                    "algorithm": "max",
                    "quant_cfg": {
                        "*weight_quantizer": quantizer,
                        "*input_quantizer": dict(quantizer),
                        "default": {"enable": False},
                    },  # fmt: skip
                },
            },
        }


@dataclass(frozen=True)
class InklingConfig:
    """The whole model (`model_type = "inkling_mm_model"`), with the NVFP4 description if quantized."""

    text: TextConfig = field(default_factory=TextConfig)
    vision: VisionConfig = field(default_factory=VisionConfig)
    audio: AudioConfig = field(default_factory=AudioConfig)
    mtp: MTPConfig = field(default_factory=MTPConfig)
    image_token_id: int = 200054
    audio_token_id: int = 200053
    image_bos_token_id: int = 200005
    audio_bos_token_id: int = 200020
    eos_token_id: int | None = None  # the published config.json says 200006; transformers defines none
    dtype: str = "bfloat16"
    quant: QuantConfig | None = None

    def __post_init__(self) -> None:
        V = self.text.vocab_size
        for name in (
            "image_token_id",
            "audio_token_id",
            "image_bos_token_id",
            "audio_bos_token_id",
            "eos_token_id",
        ):
            v = getattr(self, name)
            _require(v is None or 0 <= v < V, CONFIG_FILE, f"{name} {v} lies outside the vocabulary [0, {V})")
        _require(
            self.dtype in ("bfloat16", "float32", "float16"), CONFIG_FILE, f"unknown dtype {self.dtype!r}"
        )

    @property
    def is_quantized(self) -> bool:
        return self.quant is not None

    # The text model's sizes that the runtime reads of any model it serves.
    hidden_size = property(lambda self: self.text.hidden_size)
    vocab_size = property(lambda self: self.text.vocab_size)
    rms_norm_eps = property(lambda self: self.text.rms_norm_eps)
    sconv_kernel_size = property(lambda self: self.text.conv_kernel_size)
    num_mtp_heads = property(lambda self: self.mtp.num_layers)

    def experts_quantized(self, layer: int) -> bool:
        """Whether layer `layer`'s routed experts are NVFP4 (the published file keeps layer 2's in BF16)."""
        if self.quant is None or self.text.is_dense(layer):
            return False
        return not self.quant.is_excluded(f"model.llm.layers.{layer}.mlp.experts")

    def mtp_attention(self, depth: int) -> AttentionShape:
        return self.text.attention_of(self.mtp.layer_types[depth])

    def replace(self, **changes: Any) -> InklingConfig:
        return dataclasses.replace(self, **changes)

    # Reading.
    @classmethod
    def from_dict(cls, d: Any, where: str = CONFIG_FILE, quant: QuantConfig | None = None) -> InklingConfig:
        _require(isinstance(d, dict), where, f"must be a JSON object, got {type(d).__name__}")
        mt = d.get("model_type")
        _require(
            mt == MODEL_TYPE, where, f"not an Inkling config: model_type is {mt!r}, expected {MODEL_TYPE!r}"
        )
        for sub in ("text_config", "vision_config", "audio_config"):
            _require(sub in d, where, f"{sub} is missing")
            _require(isinstance(d[sub], dict), where, f"{sub} must be an object, got {type(d[sub]).__name__}")
        text = _text_from_dict(d["text_config"], f"{where}: text_config", d.get("mtp_config"))
        mtp = _mtp_from_dict(d, f"{where}: mtp_config")
        v = d["vision_config"]
        a = d["audio_config"]
        dtype = (
            d.get("dtype")
            or d.get("torch_dtype")
            or d["text_config"].get("torch_dtype")
            or d["text_config"].get("dtype")
            or "bfloat16"
        )
        try:
            # transformers reads num_channels and leaves the published spelling n_channels unread
            vision = VisionConfig(v.get("patch_size", 40), v.get("temporal_patch_size", 2), v.get("num_channels", 3),
                                  v.get("n_layers", v.get("num_hidden_layers", 24)))  # fmt: skip
            audio = AudioConfig(a.get("n_mel_bins", a.get("num_codebooks", 80)),
                                a.get("mel_vocab_size", a.get("codebook_size", 256)))  # fmt: skip
            eos = d.get("eos_token_id")
            return cls(
                text, vision, audio, mtp,
                image_token_id=d.get("image_token_id", 200054), audio_token_id=d.get("audio_token_id", 200053),
                image_bos_token_id=d.get("image_bos_token_id", 200005),
                audio_bos_token_id=d.get("audio_bos_token_id", 200020),
                eos_token_id=eos[0] if isinstance(eos, list) and eos else eos, dtype=dtype, quant=quant,
            )  # fmt: skip
        except ConfigError as e:
            msg = str(e).removeprefix(f"{CONFIG_FILE}: ")  # the top level's own checks name the file
            raise ConfigError(f"{where}: {msg}") from None

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> InklingConfig:
        """config.json of a checkpoint directory, with its hf_quant_config.json when it has one."""
        path = os.fspath(path)
        directory = path if os.path.isdir(path) else os.path.dirname(path)
        file = os.path.join(path, CONFIG_FILE) if os.path.isdir(path) else path
        quant_file = os.path.join(directory, QUANT_CONFIG_FILE)
        quant = (
            QuantConfig.from_dict(_read_json(quant_file), quant_file) if os.path.exists(quant_file) else None
        )
        return cls.from_dict(_read_json(file), file, quant)

    # Writing: the published spelling.
    def to_dict(self) -> dict[str, Any]:
        t = self.text
        text: dict[str, Any] = {
            f.name: getattr(t, f.name)
            for f in dataclasses.fields(t)
            if f.name not in ("where", "layer_types", "mlp_layer_types", "intermediate_size", "moe_intermediate_size",
                              "max_position_embeddings", "conv_kernel_size", "sliding_window_size")
        }  # fmt: skip
        text.update(
            model_max_length=t.max_position_embeddings, sconv_kernel_size=t.conv_kernel_size,
            sliding_window_size=t.sliding_window_size, torch_dtype=self.dtype,
            local_layer_ids=[i for i, k in enumerate(t.layer_types) if k == SLIDING],
            intermediate_size=t.moe_intermediate_size, dense_intermediate_size=t.intermediate_size,
        )  # fmt: skip
        dense = [i for i, k in enumerate(t.mlp_layer_types) if k == DENSE]
        if dense == list(range(len(dense))):
            text["dense_mlp_idx"] = len(dense)
        else:  # not a prefix: only transformers' own spelling says it
            text["mlp_layer_types"] = list(t.mlp_layer_types)
        text.update({k: v for k, v in _HARD_WIRED.items()})
        out: dict[str, Any] = {
            "architectures": ["InklingForConditionalGeneration"],
            "model_type": MODEL_TYPE,
            "text_config": text,
            "vision_config": {
                "vision_encoder_type": "hmlp",
                "patch_size": self.vision.patch_size,
                "temporal_patch_size": self.vision.temporal_patch_size,
                "n_channels": self.vision.num_channels,
                "n_layers": self.vision.n_layers,
            },  # fmt: skip
            "audio_config": {
                "audio_mode": "dmel",
                "n_mel_bins": self.audio.n_mel_bins,
                "mel_vocab_size": self.audio.mel_vocab_size,
            },  # fmt: skip
            "image_token_id": self.image_token_id,
            "audio_token_id": self.audio_token_id,
            "image_bos_token_id": self.image_bos_token_id,
            "audio_bos_token_id": self.audio_bos_token_id,
        }
        if self.eos_token_id is not None:
            out["eos_token_id"] = self.eos_token_id
        if self.mtp.num_layers:
            out["mtp_config"] = {
                "num_nextn_predict_layers": self.mtp.num_layers,
                "chain_hidden_post_norm": self.mtp.chain_hidden_post_norm,
                "local_layer_ids": list(self.mtp.local_layer_ids or ()),
            }
            for key in ("log_scaling", "target_hidden_pre_norm"):  # written only where switched on
                if getattr(self.mtp, key):
                    out["mtp_config"][key] = True
        return out

    def save(self, directory: str | os.PathLike, modelopt_version: str = "0.47.0") -> None:
        directory = os.fspath(directory)
        _write_json(os.path.join(directory, CONFIG_FILE), self.to_dict())
        if self.quant is not None:
            _write_json(os.path.join(directory, QUANT_CONFIG_FILE), self.quant.to_dict(modelopt_version))


def _text_from_dict(src: dict[str, Any], where: str, mtp_config: Any) -> TextConfig:
    d = dict(src)
    for alias, stored in _TEXT_ALIASES:
        if alias in d:
            if stored in d and d[stored] != d[alias]:
                raise ConfigError(f"{where}: {alias} ({d[alias]!r}) and {stored} ({d[stored]!r}) disagree")
            d[stored] = d.pop(alias)
    for key, value in _HARD_WIRED.items():
        if key in d:
            _require(
                d[key] == value, where, f"{key} = {d[key]!r} is not supported: the model hard-wires {value!r}"
            )
    names = {f.name for f in dataclasses.fields(TextConfig)} - {"where", "layer_types", "mlp_layer_types"}
    kw: dict[str, Any] = {k: d[k] for k in names if k in d}
    L = d.get("num_hidden_layers", 66)
    _require(isinstance(L, int) and L > 0, where, f"num_hidden_layers must be a positive integer, got {L!r}")
    # The order of transformers' post-init (INKLING_SPEC §1.4): layer types, MLP types, then the widths.
    local = d.get("local_layer_ids")
    local = None if local is None else _int_tuple(local, where, "local_layer_ids")
    if d.get("layer_types") is not None:
        kw["layer_types"] = tuple(d["layer_types"])
        if local is not None:
            _require(default_layer_types(L, local) == kw["layer_types"], where,
                     "layer_types and local_layer_ids disagree")  # fmt: skip
    else:
        kw["layer_types"] = default_layer_types(L, local)
    if d.get("mlp_layer_types") is not None:
        kw["mlp_layer_types"] = tuple(d["mlp_layer_types"])
    else:
        n_dense = d.get("dense_mlp_idx", 0)
        _require(
            isinstance(n_dense, int) and 0 <= n_dense <= L,
            where,
            f"dense_mlp_idx must lie in [0, {L}], got {n_dense!r}",
        )
        kw["mlp_layer_types"] = tuple(DENSE if i < n_dense else SPARSE for i in range(L))
    if d.get("dense_intermediate_size") is not None:  # the checkpoint's meaning of the widths
        kw["moe_intermediate_size"] = d.get("intermediate_size", 24576)
        kw["intermediate_size"] = d["dense_intermediate_size"]
    try:
        return TextConfig(**kw, where=where)
    except TypeError as e:
        raise ConfigError(f"{where}: {e}") from None


def _mtp_from_dict(d: dict[str, Any], where: str) -> MTPConfig:
    """The text config's own MTP fields win over the top-level mtp_config, as in transformers."""
    text, block = d["text_config"], d.get("mtp_config") or {}
    _require(isinstance(block, dict), where, f"must be an object, got {type(block).__name__}")
    n = text.get("num_mtp_layers", block.get("num_nextn_predict_layers"))
    local = text.get("mtp_local_layer_ids", block.get("local_layer_ids"))
    chain = text.get("chain_hidden_post_norm", block.get("chain_hidden_post_norm", False))
    _require(
        n is None or (isinstance(n, int) and n >= 0),
        where,
        f"num_nextn_predict_layers must be >= 0, got {n!r}",
    )
    _require(
        not chain, where, "chain_hidden_post_norm = true is not supported (no published checkpoint has it)"
    )
    switches = {}
    for key in ("log_scaling", "target_hidden_pre_norm"):
        value = block.get(key, False)
        _require(isinstance(value, bool), where, f"{key} must be true or false, got {value!r}")
        switches[key] = value
    try:
        return MTPConfig(
            n or 0,
            None if local is None else _int_tuple(local, where, "local_layer_ids"),
            bool(chain),
            **switches,
        )
    except ConfigError as e:  # its own checks name the block; add the file
        raise ConfigError(f"{where.removesuffix(': mtp_config')}: {e}") from None


def _read_json(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None


def _write_json(path: str, data: Any) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")


def published_exclude_modules(c: InklingConfig, bf16_first_moe: bool = True) -> tuple[str, ...]:
    """The modules an NVFP4 checkpoint keeps unquantized, as exclude_modules lists them: everything of the
    trunk and towers but the routed experts of MoE layers after the first (INKLING_SERVING §2.2). The
    published list's exact entries are not visible in any public source; its meaning is this. MTP is
    BF16 but not listed, as in the published file. bf16_first_moe=False: the first MoE layer quantized too
    (inkling-bench, whose layers stand for the 1T's 60-65)."""
    t = c.text
    out = ["model.llm.embed", "model.llm.embed_norm"]
    first_moe = next((i for i in range(t.num_hidden_layers) if not t.is_dense(i)), None)
    if not bf16_first_moe:
        first_moe = None
    for i in range(t.num_hidden_layers):
        p = f"model.llm.layers.{i}."
        out += [p + m for m in ("attn_norm", "attn", "attn_sconv", "mlp_norm", "mlp_sconv")]
        if t.is_dense(i):
            out.append(p + "mlp")
        else:
            out += [p + "mlp.gate", p + "mlp.shared_experts"]
            if i == first_moe:
                out.append(p + "mlp.experts")
    return (*out, "model.llm.norm", "model.llm.unembed", "model.visual", "model.audio")


# Presets (INKLING_SPEC "Presets").

_MTP_LOCAL = (0, 2, 4, 5, 6, 7)  # the published depths 1 and 3 are full attention
_INKLING_1T = InklingConfig(
    text=TextConfig(
        unpadded_vocab_size=200058,
        log_scaling_n_floor=128000,
        max_position_embeddings=1048576,
        mlp_layer_types=(DENSE, DENSE) + (SPARSE,) * 64,
    ),  # fmt: skip
    vision=VisionConfig(n_layers=4),
    audio=AudioConfig(mel_vocab_size=16),
    mtp=MTPConfig(8, _MTP_LOCAL),
    eos_token_id=200006,
)
_INKLING_SMALL = _INKLING_1T.replace(
    text=dataclasses.replace(
        _INKLING_1T.text, hidden_size=4096, num_hidden_layers=42, num_attention_heads=32,
        swa_num_attention_heads=32, swa_num_key_value_heads=8, intermediate_size=16384,
        moe_intermediate_size=2048, logits_mup_width_multiplier=16.0, layer_types=(),
        mlp_layer_types=(DENSE, DENSE) + (SPARSE,) * 40,
    ),
)  # fmt: skip
# Six consecutive NVFP4 MoE layers of the 1T (60-65: five sliding, one full), its embedding, unembedding,
# towers and 8 MTP depths: the single-H200 performance workload.
_INKLING_BENCH = _INKLING_1T.replace(
    text=dataclasses.replace(
        _INKLING_1T.text,
        num_hidden_layers=6,
        layer_types=(SLIDING,) * 5 + (FULL,),
        mlp_layer_types=(SPARSE,) * 6,
    ),
)
# The real architecture at toy widths, every feature on: sliding and full layers with their own head
# counts, dense and MoE layers (the first MoE layer keeps BF16 experts when quantized), log scaling with
# a floor the tests pass, a relative extent and a window shorter than the test prompts, a padded
# vocabulary, the towers (at their real, fixed widths) and MTP depths of both attention kinds. The
# special tokens keep the real layout at the top of the unpadded vocabulary (inkling/published/tokens.py).
TINY_UNPADDED_VOCAB = 1024
_INKLING_TINY = InklingConfig(
    text=TextConfig(
        vocab_size=1088, unpadded_vocab_size=TINY_UNPADDED_VOCAB, hidden_size=64, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16,
        swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16,
        sliding_window_size=16, d_rel=4, rel_extent=24, log_scaling_n_floor=20, max_position_embeddings=4096,
        layer_types=tuple(FULL if i in (3, 7) else SLIDING for i in range(8)),
        mlp_layer_types=(DENSE, DENSE) + (SPARSE,) * 6, intermediate_size=96, moe_intermediate_size=32,
        n_routed_experts=16, num_experts_per_tok=6, n_shared_experts=2, logits_mup_width_multiplier=4.0,
    ),
    vision=VisionConfig(n_layers=4),
    audio=AudioConfig(mel_vocab_size=16),
    mtp=MTPConfig(8, _MTP_LOCAL),
    **tiny_token_ids(TINY_UNPADDED_VOCAB),
)  # fmt: skip

PRESETS = {"inkling-1t": _INKLING_1T, "inkling-small": _INKLING_SMALL, "inkling-bench": _INKLING_BENCH,
           "inkling-tiny": _INKLING_TINY}  # fmt: skip


def preset(name: str, nvfp4: bool = False) -> InklingConfig:
    """A preset; `nvfp4` adds the published quantization (routed experts of every MoE layer but the first)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; expected one of {list(PRESETS)}")
    config = PRESETS[name]
    if nvfp4:
        # inkling-bench's layers stand for the 1T's layers 60-65, all of them NVFP4
        exclude = published_exclude_modules(config, bf16_first_moe=name != "inkling-bench")
        config = config.replace(quant=QuantConfig(exclude_modules=exclude))
    return config
