"""Inkling configuration: frozen dataclasses for every field of INKLING_SPEC §1.

`InklingConfig.from_dict` / `from_json` read a checkpoint's config.json, `to_dict` / `save` write it;
`__post_init__` validates, so an invalid config cannot exist. Presets: `preset(name)`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

FULL = "full_attention"
SLIDING = "sliding_attention"
LAYER_TYPES = (FULL, SLIDING)

SPECIAL_TOKENS = (
    "bos",
    "eos",
    "pad",
    "image",
    "image_start",
    "image_end",
    "image_pad",
    "audio",
    "audio_start",
    "audio_end",
    "audio_pad",
)
"""Names of the special tokens; the text of each is `<|name|>`, its id `<name>_token_id` in config.json."""


class ConfigError(ValueError):
    """A config.json that does not describe a valid Inkling model."""


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def default_layer_types(num_layers: int) -> tuple[str, ...]:
    """Layer i is full attention iff i % 6 == 5 (INKLING_SPEC §1)."""
    return tuple(FULL if i % 6 == 5 else SLIDING for i in range(num_layers))


@dataclass(frozen=True)
class VisionConfig:
    patch_size: int = 16
    hmlp_dims: tuple[int, int] = (512, 2048)
    max_image_side: int = 1024

    def __post_init__(self) -> None:
        object.__setattr__(self, "hmlp_dims", tuple(int(d) for d in self.hmlp_dims))
        _require(
            self.patch_size == 16,
            f"vision.patch_size must be 16 (4x4 then 2x2 then 2x2), got {self.patch_size}",
        )
        _require(len(self.hmlp_dims) == 2, f"vision.hmlp_dims must be [d1, d2], got {list(self.hmlp_dims)}")
        _require(
            all(d > 0 for d in self.hmlp_dims),
            f"vision.hmlp_dims must be positive, got {list(self.hmlp_dims)}",
        )
        _require(
            self.max_image_side >= self.patch_size,
            f"vision.max_image_side ({self.max_image_side}) must be at least the patch size",
        )


@dataclass(frozen=True)
class AudioConfig:
    sample_rate: int = 16000
    n_fft: int = 400
    hop_length: int = 160
    num_mels: int = 80
    num_levels: int = 16
    log_min: float = -11.5
    log_max: float = 2.0
    frame_stack: int = 4
    embed_dim: int = 1024

    def __post_init__(self) -> None:
        for name in (
            "sample_rate",
            "n_fft",
            "hop_length",
            "num_mels",
            "num_levels",
            "frame_stack",
            "embed_dim",
        ):
            _require(getattr(self, name) > 0, f"audio.{name} must be positive, got {getattr(self, name)}")
        _require(
            self.log_max > self.log_min,
            f"audio.log_max ({self.log_max}) must exceed log_min ({self.log_min})",
        )
        _require(self.num_levels >= 2, f"audio.num_levels must be at least 2, got {self.num_levels}")


@dataclass(frozen=True)
class InklingConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rel_head_dim: int
    max_relative_distance: int
    sliding_window: int
    num_routed_experts: int
    num_experts_per_tok: int
    num_shared_experts: int
    moe_intermediate_size: int
    num_mtp_heads: int
    mtp_intermediate_size: int
    head_dim: int = 128
    sconv_kernel_size: int = 4
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 1048576
    layer_types: tuple[str, ...] = ()
    vision: VisionConfig = field(default_factory=VisionConfig)
    audio: AudioConfig = field(default_factory=AudioConfig)
    token_ids: dict[str, int] = field(default_factory=dict)
    tie_word_embeddings: bool = False
    torch_dtype: str = "bfloat16"
    quantization_config: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if not self.layer_types:
            object.__setattr__(self, "layer_types", default_layer_types(self.num_hidden_layers))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if isinstance(self.vision, dict):
            object.__setattr__(self, "vision", VisionConfig(**self.vision))
        if isinstance(self.audio, dict):
            object.__setattr__(self, "audio", AudioConfig(**self.audio))
        self._validate()

    def _validate(self) -> None:
        positive = (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "rel_head_dim",
            "max_relative_distance",
            "sliding_window",
            "num_routed_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "sconv_kernel_size",
            "max_position_embeddings",
        )
        for name in positive:
            _require(getattr(self, name) > 0, f"{name} must be positive, got {getattr(self, name)}")
        _require(
            self.num_shared_experts >= 0, f"num_shared_experts must be >= 0, got {self.num_shared_experts}"
        )
        _require(self.num_mtp_heads >= 0, f"num_mtp_heads must be >= 0, got {self.num_mtp_heads}")
        _require(
            self.num_mtp_heads == 0 or self.mtp_intermediate_size > 0,
            f"mtp_intermediate_size must be positive when there are MTP heads, got {self.mtp_intermediate_size}",
        )
        _require(self.head_dim == 128, f"head_dim must be 128 (INKLING_SPEC §1), got {self.head_dim}")
        _require(
            self.num_attention_heads % self.num_key_value_heads == 0,
            f"num_attention_heads ({self.num_attention_heads}) is not divisible by "
            f"num_key_value_heads ({self.num_key_value_heads})",
        )
        _require(
            self.num_experts_per_tok <= self.num_routed_experts,
            f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_routed_experts "
            f"({self.num_routed_experts})",
        )
        _require(
            len(self.layer_types) == self.num_hidden_layers,
            f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers",
        )
        bad = sorted({t for t in self.layer_types if t not in LAYER_TYPES})
        _require(not bad, f"unknown layer_types {bad}; expected {list(LAYER_TYPES)}")
        _require(self.rms_norm_eps > 0, f"rms_norm_eps must be positive, got {self.rms_norm_eps}")
        _require(not self.tie_word_embeddings, "tie_word_embeddings must be false for Inkling")
        for name, tid in self.token_ids.items():
            _require(
                name in SPECIAL_TOKENS, f"unknown special token {name!r}; expected one of {SPECIAL_TOKENS}"
            )
            _require(
                0 <= tid < self.vocab_size,
                f"{name}_token_id {tid} outside the vocabulary [0, {self.vocab_size})",
            )
        _require(
            len(set(self.token_ids.values())) == len(self.token_ids),
            f"special token ids are not distinct: {self.token_ids}",
        )

    # Derived values.
    @cached_property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @cached_property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @cached_property
    def r_size(self) -> int:
        return self.num_attention_heads * self.rel_head_dim

    @cached_property
    def qkvr_size(self) -> int:
        return self.q_size + 2 * self.kv_size + self.r_size

    @cached_property
    def num_router_outputs(self) -> int:
        return self.num_routed_experts + self.num_shared_experts

    @cached_property
    def is_quantized(self) -> bool:
        return self.quantization_config is not None

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING

    def token_id(self, name: str) -> int:
        if name not in self.token_ids:
            raise ConfigError(f"config.json has no {name}_token_id")
        return self.token_ids[name]

    # config.json
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"architectures": ["InklingForConditionalGeneration"], "model_type": "inkling"}
        for f in dataclasses.fields(self):
            if f.name in ("token_ids", "vision", "audio", "quantization_config"):
                continue
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        out["vision"] = {**dataclasses.asdict(self.vision), "hmlp_dims": list(self.vision.hmlp_dims)}
        out["audio"] = dataclasses.asdict(self.audio)
        for name in SPECIAL_TOKENS:
            if name in self.token_ids:
                out[f"{name}_token_id"] = self.token_ids[name]
        if self.quantization_config is not None:
            out["quantization_config"] = self.quantization_config
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> InklingConfig:
        if not isinstance(d, dict):
            raise ConfigError(f"config must be a JSON object, got {type(d).__name__}")
        if d.get("model_type") != "inkling":
            raise ConfigError(
                f"not an Inkling config: model_type is {d.get('model_type')!r}, expected 'inkling'"
            )
        names = {f.name for f in dataclasses.fields(cls)} - {"token_ids"}
        kwargs: dict[str, Any] = {k: v for k, v in d.items() if k in names}
        kwargs["token_ids"] = {
            n: int(d[f"{n}_token_id"]) for n in SPECIAL_TOKENS if d.get(f"{n}_token_id") is not None
        }
        required = [
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        missing = [n for n in required if n not in kwargs]
        if missing:
            raise ConfigError(f"config.json is missing {missing}")
        try:
            if "vision" in kwargs:
                kwargs["vision"] = VisionConfig(**kwargs["vision"])
            if "audio" in kwargs:
                kwargs["audio"] = AudioConfig(**kwargs["audio"])
            return cls(**kwargs)
        except TypeError as e:
            raise ConfigError(f"invalid config.json: {e}") from e

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> InklingConfig:
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        try:
            with open(path) as f:
                data = json.load(f)
        except FileNotFoundError as e:
            raise ConfigError(f"no config.json at {path}") from e
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from e
        return cls.from_dict(data)

    def save(self, path: str | os.PathLike) -> None:
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")

    def replace(self, **changes: Any) -> InklingConfig:
        """A new validated config with some fields changed. A config whose layer_types follow the default
        rule keeps following it when num_hidden_layers changes (a slice of the model)."""
        if (
            "num_hidden_layers" in changes
            and "layer_types" not in changes
            and self.layer_types == default_layer_types(self.num_hidden_layers)
        ):
            changes["layer_types"] = ()
        return dataclasses.replace(self, **changes)


_PRESETS: dict[str, dict[str, Any]] = {
    "inkling-1t": dict(
        vocab_size=200192,
        hidden_size=7168,
        num_hidden_layers=66,
        num_attention_heads=64,
        num_key_value_heads=8,
        rel_head_dim=32,
        max_relative_distance=8192,
        sliding_window=4096,
        num_routed_experts=256,
        num_experts_per_tok=6,
        num_shared_experts=2,
        moe_intermediate_size=2560,
        num_mtp_heads=8,
        mtp_intermediate_size=18432,
        vision=VisionConfig(hmlp_dims=(512, 2048), max_image_side=1024),
        audio=AudioConfig(embed_dim=1024),
    ),
    "inkling-tiny": dict(
        vocab_size=1024,
        hidden_size=256,
        num_hidden_layers=6,
        num_attention_heads=2,
        num_key_value_heads=1,
        rel_head_dim=16,
        max_relative_distance=64,
        sliding_window=32,
        num_routed_experts=16,
        num_experts_per_tok=6,
        num_shared_experts=2,
        moe_intermediate_size=64,
        num_mtp_heads=8,
        mtp_intermediate_size=256,
        vision=VisionConfig(hmlp_dims=(32, 64), max_image_side=64),
        audio=AudioConfig(embed_dim=32),
    ),
}
_PRESETS["inkling-bench"] = {**_PRESETS["inkling-1t"], "num_hidden_layers": 6}

PRESET_NAMES = tuple(_PRESETS)


def preset(name: str, **overrides: Any) -> InklingConfig:
    """A preset config (`inkling-1t`, `inkling-tiny`, `inkling-bench`); token ids come from the tokenizer
    (`inkling.tokenizer`) and are passed as `token_ids=...` by the synth tool. inkling-tiny's vocab_size is
    its tokenizer's size, which the synth tool also sets."""
    if name not in _PRESETS:
        raise ConfigError(f"unknown preset {name!r}; expected one of {list(_PRESETS)}")
    return InklingConfig(**{**_PRESETS[name], **overrides})
