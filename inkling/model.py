"""The plain-PyTorch reference model: the numerical truth for everything after it (INKLING_SPEC §3–§7).

    model = InklingReference.from_pretrained(path, dtype=torch.float32)
    logits, hidden = model(input_ids, images=[pixels], audios=[levels])   # float32 [T, V], [T, H]
    heads = model.mtp_logits(hidden, input_ids, images=..., audios=...)  # list of M, [T-m, V]
    ids = model.generate(input_ids, max_new_tokens=16)

It recomputes the whole sequence on each call: no cache, nothing clever.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from torch import nn

from .config import InklingConfig
from .encoders import Audio, Vision
from .layers import DecoderLayer, MTPHead, RMSNorm, linear


def _tokenizer_size(path: str | os.PathLike) -> int | None:
    file = os.path.join(os.fspath(path), "tokenizer.json")
    if not os.path.exists(file):
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(file).get_vocab_size(with_added_tokens=True)


class InklingModel(nn.Module):
    """`model.*`: embeddings, the decoder layers and the final norm."""

    def __init__(self, c: InklingConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class InklingReference(nn.Module):
    def __init__(self, config: InklingConfig):
        super().__init__()
        self.config = config
        self.model = InklingModel(config)
        self.lm_head = linear(config.hidden_size, config.vocab_size)
        self.mtp = nn.ModuleList(MTPHead(config) for _ in range(config.num_mtp_heads))
        self.vision = Vision(config)
        self.audio = Audio(config)
        # Rows past the tokenizer's size are padding for kernels and never sampled (§1).
        self.num_real_tokens = config.vocab_size

    # Loading.
    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cpu",
        cache_dequantized: bool = False,
    ) -> InklingReference:
        """Load any checkpoint that follows the spec, bf16 or NVFP4 (routed experts stay packed and are
        dequantized per expert as it is used; `cache_dequantized` keeps each expert's dense weight after
        its first use, for small models). Tensors are read one at a time, never with pickle."""
        from .checkpoint import CheckpointReader

        with CheckpointReader(path) as reader:
            with torch.device("meta"):
                model = cls(reader.config)
            for name in reader.keys():
                model._assign(name, reader.get(name, device=device), dtype)
        model._check_loaded()
        model.num_real_tokens = _tokenizer_size(path) or model.config.vocab_size
        if cache_dequantized:
            for module in model.modules():
                if hasattr(module, "cache") and hasattr(module, "dequantized_weight"):
                    module.cache = True
        return model.eval()

    @classmethod
    def from_tensors(
        cls, config: InklingConfig, tensors, dtype: torch.dtype = torch.bfloat16
    ) -> InklingReference:
        """Build from an iterable of (name, tensor), e.g. `inkling.synth.iter_synthetic_tensors`."""
        with torch.device("meta"):
            model = cls(config)
        for name, tensor in tensors:
            model._assign(name, tensor, dtype)
        model._check_loaded()
        return model.eval()

    def _assign(self, name: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
        module_name, _, attr = name.rpartition(".")
        module = self.get_submodule(module_name)
        if attr in module._parameters:
            current = module._parameters[attr]
            if tuple(current.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"{name}: checkpoint shape {list(tensor.shape)}, model expects {list(current.shape)}"
                )
            module._parameters[attr] = nn.Parameter(tensor.to(dtype), requires_grad=False)
        elif attr in module._buffers:  # NVFP4 codes and scales keep their own dtypes
            module._buffers[attr] = tensor
        else:
            raise ValueError(f"checkpoint tensor {name} has no place in the model")

    def _check_loaded(self) -> None:
        missing = [n for n, t in [*self.named_parameters(), *self.named_buffers()] if t.is_meta]
        if missing:
            raise ValueError(f"checkpoint did not provide {len(missing)} tensors, e.g. {missing[:3]}")

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    # Inputs.
    def embed(
        self,
        input_ids: torch.Tensor,
        images: Sequence[torch.Tensor] | None = None,
        audios: Sequence[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Token embeddings with image and audio pad positions replaced (§6, §7): [T, H]."""
        if input_ids.dim() != 1:
            raise ValueError(f"input_ids must be 1-D, got shape {list(input_ids.shape)}")
        e = self.model.embed_tokens(input_ids)
        c = self.config
        for kind, items, encoder in (("image", images, self.vision), ("audio", audios, self.audio)):
            pad_id = c.token_ids.get(f"{kind}_pad")
            positions = (input_ids == pad_id).nonzero().flatten() if pad_id is not None else input_ids[:0]
            if not items:
                if len(positions):
                    raise ValueError(
                        f"prompt has {len(positions)} <|{kind}_pad|> tokens but no {kind}s were given"
                    )
                continue
            if kind == "audio":
                for x in items:
                    self.audio.check_levels(x)
            embeds = torch.cat([encoder(x.to(e.device)) for x in items]).to(e.dtype)
            if embeds.shape[0] != len(positions):
                raise ValueError(
                    f"{len(items)} {kind}(s) give {embeds.shape[0]} embeddings for {len(positions)} <|{kind}_pad|> tokens"
                )
            e = e.index_copy(0, positions, embeds)
        return e

    # The model.
    def forward(
        self,
        input_ids: torch.Tensor,
        images: Sequence[torch.Tensor] | None = None,
        audios: Sequence[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns float32 logits [T, V] and the last layer's hidden states h0 [T, H] (before the final norm)."""
        x = self.embed(input_ids, images, audios)
        for layer in self.model.layers:
            x = layer(x)
        return self.logits(self.model.norm(x)), x

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        return (normed @ self.lm_head.weight.T).float()

    def mtp_logits(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        images: Sequence[torch.Tensor] | None = None,
        audios: Sequence[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """The heads' logits over known tokens (§5): entry m-1 is head m at positions 0..T-1-m, [T-m, V],
        row t predicting x[t+m+1]. The heads read the spliced input embeddings, as the main model did."""
        e = self.embed(input_ids, images, audios)
        out = []
        h = hidden
        for m, head in enumerate(self.mtp, start=1):
            T_m = input_ids.shape[0] - m
            if T_m <= 0:
                break
            h = head(h[:T_m], e[m : m + T_m])
            out.append(self.logits(head.final_layernorm(h)))
        return out

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        images: Sequence[torch.Tensor] | None = None,
        audios: Sequence[torch.Tensor] | None = None,
        stop_ids: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Greedy decoding by full recomputation; returns the new tokens only (stops after a stop id)."""
        if stop_ids is None:
            stop_ids = [self.config.token_ids["eos"]] if "eos" in self.config.token_ids else []
        ids = input_ids.clone()
        new: list[int] = []
        for _ in range(max_new_tokens):
            logits, _ = self(ids, images, audios)
            token = int(logits[-1, : self.num_real_tokens].argmax())
            new.append(token)
            if token in stop_ids:
                break
            ids = torch.cat([ids, ids.new_tensor([token])])
        return torch.tensor(new, dtype=torch.long)

    def draft(
        self,
        input_ids: torch.Tensor,
        num_draft_tokens: int,
        images: Sequence[torch.Tensor] | None = None,
        audios: Sequence[torch.Tensor] | None = None,
        h0: torch.Tensor | None = None,
        draft_vocab: Sequence[int] | None = None,
    ) -> list[int]:
        """Greedy MTP drafts from x[0..N+1] by full recomputation (§5 Decoding): see `inkling.mtp.draft`."""
        from .mtp import draft

        return draft(self, input_ids, num_draft_tokens, images, audios, h0, draft_vocab)
