"""The training model computes the reference's function; the mixture's samples are what they claim."""

from __future__ import annotations

import torch

from inkling.tokenizer import build_tokenizer
from train import small_config
from train.__main__ import losses
from train.data import ANSWER, QUESTION, Mixture
from train.model import forward, new_model


def _config(tok):
    # Windows and relative distances far shorter than the sequence, so both edges are exercised.
    return small_config(tok).replace(sliding_window=8, max_relative_distance=12, num_mtp_heads=3)


def test_batched_forward_equals_reference():
    tok = build_tokenizer()
    model = new_model(_config(tok), seed=3)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(11, tok.get_vocab_size(), (3, 40), generator=gen)
    with torch.no_grad():
        logits, heads = forward(model, ids)
        for b in range(ids.shape[0]):
            ref_logits, hidden = model(ids[b])
            torch.testing.assert_close(logits[b].float(), ref_logits, rtol=1e-4, atol=1e-4)
            ref_heads = model.mtp_logits(hidden, ids[b])
            assert len(heads) == len(ref_heads) == 3
            for m, (h, r) in enumerate(zip(heads, ref_heads), start=1):
                assert h.shape[1] == ids.shape[1] - m
                torch.testing.assert_close(h[b].float(), r, rtol=1e-4, atol=1e-4)


def test_training_steps_reduce_the_loss():
    tok = build_tokenizer()
    model = new_model(_config(tok), seed=0)
    data = Mixture(tok, seq_len=96, seed=0)
    ids, weights = data.batch(2)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = None
    for _ in range(8):
        main, heads = losses(model, ids, weights, autocast=False)
        loss = main + 0.5 * torch.stack(heads).mean()
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < first - 0.5, (first, loss.item())
    # Gradients reach the heads, the router and the relative table.
    grads = {n: p.grad for n, p in model.named_parameters()}
    for name in (
        "mtp.2.eh_proj.weight",
        "model.layers.0.mlp.router.weight",
        "model.layers.5.self_attn.rel_embed",
    ):
        assert grads[name] is not None and grads[name].abs().sum() > 0, name


def test_mixture_rows_and_needles():
    tok = build_tokenizer()
    data = Mixture(tok, seq_len=512, seed=1)
    ids, weights = data.batch(4)
    assert ids.shape == weights.shape == (4, 512)
    assert (ids[:, 0] == tok.token_to_id("<|bos|>")).all()
    assert (weights > 1).any()
    s = data.needle(300, depth=0.5, passkey=12345)
    assert len(s.ids) == len(s.weights) == 300
    text = tok.decode(s.ids)
    assert "The secret passkey is 12345." in text
    assert text.endswith(QUESTION.strip() + ANSWER.format(12345))
    answer = [s.ids[i] for i in s.answer_positions]
    assert tok.decode(answer) == ANSWER.format(12345)
    held_out = Mixture(tok, seq_len=512, seed=1, held_out=True)
    assert held_out.text[:50] != data.text[:50]
