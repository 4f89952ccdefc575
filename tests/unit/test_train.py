"""The real Inkling's trainer (train/published.py): its batched forward is the reference's function (trunk and
MTP depths, the depths' positions as INKLING_SERVING §1 has them), its steps lower the loss and reach every
part, and the mixture's samples are what they claim."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from train.data import ANSWER, QUESTION, Mixture

pytest.importorskip("transformers")

from inkling.published.mtp import MTPReference  # noqa: E402
from inkling.published.tokens import build_tiny_tokenizer  # noqa: E402
from train.published import EOS, SEPARATOR, Trainee, losses, trained_config  # noqa: E402


def small_config():
    """The trained model's config with windows, extent and log-scaling floor far shorter than the rows, so
    every edge is crossed."""
    config = trained_config()
    text = dataclasses.replace(config.text, sliding_window_size=8, rel_extent=12, log_scaling_n_floor=16)
    return config.replace(text=text)


@pytest.fixture(scope="module")
def trainee(tmp_path_factory):
    return Trainee(small_config(), str(tmp_path_factory.mktemp("trainee")), seed=3)


def test_batched_forward_equals_the_reference(trainee):
    """Each row's main logits are the reference trunk's; depth m's logits at position t (reading h^{m-1}_t
    and token t + m) are the reference depths' over the same tokens given as a prompt and drafts."""
    reference = MTPReference(trainee.trunk, trainee.depths, trainee.config)
    M, T = len(trainee.depths), 40
    ids = torch.randint(0, 900, (2, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        trainee.eval()
        logits, heads = trainee(ids)
        assert len(heads) == M and [h.shape[1] for h in heads] == [T - m - 1 for m in range(1, M + 1)]
        for b in range(ids.shape[0]):
            torch.testing.assert_close(logits[b], reference.trunk_pass(ids[b])[2], rtol=1e-4, atol=1e-4)
            L = T - (M - 1)  # the prompt; the rest stand as drafts d_1..d_{M-1}
            states = reference.depth_states(ids[b, :L], ids[b, L:].tolist(), num_depths=M)
            for head, state in zip(heads, states):
                n = min(head.shape[1], state.shape[0])
                torch.testing.assert_close(head[b, :n], reference.logits(state)[:n], rtol=1e-4, atol=1e-4)
    trainee.train()


def test_training_steps_lower_the_loss_and_reach_every_part(trainee):
    tok = build_tiny_tokenizer(trainee.config.text.num_real_tokens)
    ids, weights = Mixture(tok, seq_len=96, seed=0, bos=SEPARATOR, eos=EOS).batch(2)
    opt = torch.optim.AdamW(trainee.parameters(), lr=3e-3)
    first = None
    for _ in range(8):
        main, heads = losses(trainee, ids, weights)
        loss = main + 0.5 * torch.stack(heads).mean()
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < first - 0.5, (first, loss.item())
    grads = {n: p.grad for n, p in trainee.named_parameters()}
    for part in ("depths.7.input_proj", "mlp.gate.weight", "rel", "embed_tokens"):
        hit = [n for n, g in grads.items() if part in n and g is not None and g.abs().sum() > 0]
        assert hit, (part, [n for n in grads if part in n][:5])


def test_mixture_rows_and_needles():
    tok = build_tiny_tokenizer(trained_config().text.num_real_tokens)
    data = Mixture(tok, seq_len=512, seed=1, bos=SEPARATOR, eos=EOS)
    ids, weights = data.batch(4)
    assert ids.shape == weights.shape == (4, 512)
    assert (ids[:, 0] == tok.token_to_id(SEPARATOR)).all()
    assert (weights > 1).any()
    s = data.needle(300, depth=0.5, passkey=12345)
    assert len(s.ids) == len(s.weights) == 300
    text = tok.decode(s.ids)
    assert "The secret passkey is 12345." in text
    assert text.endswith(QUESTION.strip() + ANSWER.format(12345))
    assert tok.decode([s.ids[i] for i in s.answer_positions]) == ANSWER.format(12345)
    held_out = Mixture(tok, seq_len=512, seed=1, held_out=True, bos=SEPARATOR, eos=EOS)
    assert held_out.text[:50] != data.text[:50]
