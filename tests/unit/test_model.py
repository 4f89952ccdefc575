"""The reference model: encoders' layouts, causality, MTP heads, determinism, bf16 against float32."""

import pytest
import torch

from inkling import ops
from inkling.config import SPECIAL_TOKENS, preset
from inkling.encoders import Audio, Vision
from inkling.layers import init_like_synth
from inkling.model import InklingReference
from inkling.processing import image_patches

TOKEN_IDS = {name: i for i, name in enumerate(SPECIAL_TOKENS)}


def tiny_model(dtype=torch.float32, seed=0, **overrides) -> InklingReference:
    c = preset("inkling-tiny", token_ids=TOKEN_IDS, **overrides)
    torch.manual_seed(seed)
    m = InklingReference(c)
    init_like_synth(m)
    return m.to(dtype).eval()


def _capture(module):
    seen = []
    module.register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach().clone()))
    return seen


def test_hmlp_patch_order_against_a_hand_built_image():
    c = preset("inkling-tiny")
    torch.manual_seed(0)
    hmlp = Vision(c)
    init_like_synth(hmlp)
    hmlp = hmlp.hmlp
    Hp, Wp = 32, 48
    img = torch.arange(Hp * Wp * 3, dtype=torch.float32).reshape(Hp, Wp, 3) / (Hp * Wp * 3)
    stage0_in, stage1_in, stage2_in = (_capture(getattr(hmlp, s)) for s in ("0", "1", "2"))
    norm0_out, norm1_out = [], []
    hmlp.norm0.register_forward_hook(lambda m, a, out: norm0_out.append(ops.gelu_tanh(out.detach())))
    hmlp.norm1.register_forward_hook(lambda m, a, out: norm1_out.append(ops.gelu_tanh(out.detach())))
    with torch.no_grad():
        out = hmlp(image_patches(img))
    w16 = Wp // 16

    def cell(x, a, b, size):
        """The row of cell (a, b) of a stage whose cells are `size` pixels: x is [N, h, w, d] per 16x16 patch."""
        per = 16 // size
        return x[(a // per) * w16 + b // per, a % per, b % per]

    for a in range(Hp // 4):
        for b in range(Wp // 4):
            for r in range(4):
                for col in range(4):
                    for ch in range(3):  # (row, col, channel) order within a 4x4 patch
                        assert (
                            cell(stage0_in[0], a, b, 4)[(r * 4 + col) * 3 + ch]
                            == img[4 * a + r, 4 * b + col, ch]
                        )
    for x_in, prev, size in ((stage1_in[0], norm0_out[0], 8), (stage2_in[0], norm1_out[0], 16)):
        d = prev.shape[-1]
        for a in range(Hp // size):
            for b in range(Wp // size):
                for n, (dr, dc) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
                    want = cell(prev, 2 * a + dr, 2 * b + dc, size // 2)
                    torch.testing.assert_close(cell(x_in, a, b, size)[n * d : (n + 1) * d], want)
    # One token per 16x16 patch, raster order: changing patch (1, 2) changes token 1 * 3 + 2 only.
    img2 = img.clone()
    img2[16:32, 32:48] += 1.0
    with torch.no_grad():
        changed = (hmlp(image_patches(img2)) - out).abs().amax(-1) > 0
    assert out.shape == (Hp // 16 * Wp // 16, c.hidden_size)
    assert changed.nonzero().flatten().tolist() == [5]


def test_dmel_embedding_sums_channel_rows():
    c = preset("inkling-tiny")
    torch.manual_seed(1)
    audio = Audio(c)
    levels = torch.randint(0, 16, (80, 8))
    levels[:, 4:] = 0  # padding frames: all levels 0, the sum of every channel's level-0 row
    with torch.no_grad():
        got = audio(levels)
        W = audio.dmel_embed.weight
        frames = torch.stack([sum(W[ch * 16 + levels[ch, f]] for ch in range(80)) for f in range(8)])
        torch.testing.assert_close(frames[4], W[0::16].sum(0))
        want = (
            torch.cat([frames[0:4].reshape(1, -1), frames[4:8].reshape(1, -1)]) @ audio.proj.weight.T
            + audio.proj.bias
        )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="multiple of 4"):
        audio(levels[:, :6])


def test_causal_prefixes_and_determinism():
    m = tiny_model()
    ids = torch.randint(11, m.config.vocab_size, (90,))  # beyond the window (32) and R (64)
    with torch.no_grad():
        logits, hidden = m(ids)
        logits_prefix, _ = m(ids[:50])
        again, _ = m(ids)
    torch.testing.assert_close(logits[:50], logits_prefix, rtol=1e-4, atol=1e-4)
    assert torch.equal(logits, again)
    assert torch.isfinite(logits).all() and logits.dtype == torch.float32 and hidden.shape == (90, 256)


def test_media_embeddings_replace_pad_tokens():
    m = tiny_model()
    img, levels = torch.randn(16, 32, 3), torch.randint(0, 16, (80, 4))
    ids = torch.tensor([0, 20, 4, 6, 6, 5, 30, 8, 10, 9, 40])
    with torch.no_grad():
        e = m.embed(ids, images=[img], audios=[levels])
        torch.testing.assert_close(e[3:5], m.vision(img))
        torch.testing.assert_close(e[8:9], m.audio(levels))
        torch.testing.assert_close(e[0], m.model.embed_tokens.weight[0])
        with pytest.raises(ValueError, match="2 embeddings for 1"):
            m.embed(torch.tensor([0, 4, 6, 5]), images=[img])
        with pytest.raises(ValueError, match="no images were given"):
            m.embed(ids)


def test_mtp_heads_follow_the_chain_definition():
    m = tiny_model()
    ids = torch.randint(11, m.config.vocab_size, (40,))
    with torch.no_grad():
        _, h0 = m(ids)
        heads = m.mtp_logits(h0, ids)
        e = m.embed(ids)
        # Head 1 at position t reads h0[t] and e[t+1]; head 2 reads head 1's states and e[t+2].
        h1 = m.mtp[0](h0[:39], e[1:40])
        torch.testing.assert_close(heads[0], m.logits(m.mtp[0].final_layernorm(h1)))
        h2 = m.mtp[1](h1[:38], e[2:40])
        torch.testing.assert_close(heads[1], m.logits(m.mtp[1].final_layernorm(h2)))
    assert [x.shape[0] for x in heads] == [39, 38, 37, 36, 35, 34, 33, 32]


def test_bf16_close_to_float32():
    ref, low = tiny_model(torch.float32), tiny_model(torch.bfloat16)
    ids = torch.randint(11, ref.config.vocab_size, (70,))
    with torch.no_grad():
        a, _ = ref(ids)
        b, _ = low(ids)
    rel = (a - b).norm() / a.norm()
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean()
    assert rel < 0.05, f"bf16 relative logit error {rel:.4f}"
    assert agree > 0.9, f"bf16 top-1 agreement {agree:.2f}"


def test_generate_is_greedy_over_real_tokens():
    m = tiny_model()
    m.num_real_tokens = 500  # rows past the tokenizer are never sampled
    ids = torch.randint(11, 500, (12,))
    out = m.generate(ids, 4, stop_ids=[])
    seq = ids
    with torch.no_grad():
        for tok in out.tolist():
            logits, _ = m(seq)
            assert tok == int(logits[-1, :500].argmax())
            seq = torch.cat([seq, torch.tensor([tok])])
