"""MTP drafting by full recomputation (INKLING_SPEC §5 "Decoding"): the reference the engine's drafts
are tested against. input_ids hold x[0..N+1]; drafts d_j stand in for x[N+1+j]."""

import pytest
import torch

from inkling import mtp
from inkling.config import SPECIAL_TOKENS, preset
from inkling.layers import init_like_synth
from inkling.model import InklingReference

TOKEN_IDS = {name: i for i, name in enumerate(SPECIAL_TOKENS)}
TOL = dict(rtol=1e-5, atol=1e-5)  # the same states computed over sequences of different lengths


def tiny_model(seed=0) -> InklingReference:
    c = preset("inkling-tiny", token_ids=TOKEN_IDS)
    torch.manual_seed(seed)
    m = InklingReference(c)
    init_like_synth(m)
    return m.float().eval()


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def prompt(n, seed=1, high=1024):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(11, high, (n,), generator=g)


def known_states(model, ids, h0):
    """Heads over the known sequence, as `mtp_logits` defines them: entry m-1 is h^m at 0..T-1-m."""
    e = model.embed(ids)
    states, h = [], h0
    for m, head in enumerate(model.mtp, start=1):
        h = head(h[: ids.shape[0] - m], e[m:])
        states.append(h)
    return states


def clear_argmax(logits, tol=1e-4):
    """False where the top-2 logits are within tol (§2: either token is then legitimate)."""
    top = logits.topk(2).values
    return bool(top[0] - top[1] > tol)


@torch.no_grad()
def test_one_draft_is_head_1_at_position_N(model):
    ids = prompt(20)
    N = ids.shape[0] - 2
    _, h0 = model(ids)
    want = int(model.mtp_logits(h0, ids)[0][N].argmax())
    assert mtp.draft(model, ids, 1) == [want]
    assert mtp.draft(model, ids, 1, h0=h0) == [want]
    assert model.draft(ids, 1, h0=h0) == [want]


@torch.no_grad()
def test_one_draft_reads_spliced_media_embeddings(model):
    img = torch.randn(16, 32, 3, generator=torch.Generator().manual_seed(2))
    ids = torch.tensor([0, 20, 4, 6, 6, 5, 30, 31, 32, 33])  # <image_start> <pad> <pad> <image_end>
    _, h0 = model(ids, images=[img])
    want = int(model.mtp_logits(h0, ids, images=[img])[0][-1].argmax())
    assert mtp.draft(model, ids, 1, images=[img]) == [want]


@torch.no_grad()
def test_states_on_known_tokens_follow_the_definition(model):
    ids = prompt(24)
    T = ids.shape[0]
    N = T - 2
    _, h0 = model(ids)
    drafts = mtp.draft(model, ids, 8, h0=h0)
    chain = mtp.head_states(model, ids, drafts[:7], h0=h0)  # heads 1..8
    known = known_states(model, ids, h0)
    heads = model.mtp_logits(h0, ids)
    assert len(chain) == 8 and all(s.shape == (N + 1, model.config.hidden_size) for s in chain)
    for m in range(1, 9):
        # Head m at t <= N+1-m reads known tokens only: rows 0..T-1-m, exactly mtp_logits's range.
        torch.testing.assert_close(chain[m - 1][: T - m], known[m - 1], **TOL)
        got = model.logits(model.mtp[m - 1].final_layernorm(chain[m - 1][: T - m]))
        torch.testing.assert_close(got, heads[m - 1], **TOL)
    # Head 1 stands on no draft: bit-identical to mtp_logits's head 1 (same length, same inputs).
    assert torch.equal(chain[0], known[0])
    # The states past N+1-m stand on the drafts: other drafts give other states there.
    other = mtp.head_states(model, ids, [(d + 1) % 1000 + 11 for d in drafts[:7]], h0=h0)
    for m in range(2, 9):
        assert torch.equal(other[m - 1][: T - m], chain[m - 1][: T - m])
        assert not torch.allclose(other[m - 1][T - m :], chain[m - 1][T - m :])


@torch.no_grad()
def test_drafts_are_the_chain_s_own_argmax(model):
    """Each draft is head m's argmax at N over the states head_states gives for the earlier drafts."""
    ids = prompt(16, seed=3)
    drafts = mtp.draft(model, ids, 8)
    chain = mtp.head_states(model, ids, drafts[:7])
    for m, state in enumerate(chain, start=1):
        logits = model.logits(model.mtp[m - 1].final_layernorm(state[-1]))
        assert int(logits.argmax()) == drafts[m - 1]


@torch.no_grad()
def test_drafts_fed_back_as_accepted_keep_earlier_states(model):
    ids = prompt(18, seed=4)
    N = ids.shape[0] - 2
    k = 6
    drafts = mtp.draft(model, ids, k)
    chain = mtp.head_states(model, ids, drafts)  # heads 1..k+1
    # All k accepted: the states at 0..N now stand on known tokens only, and equal the definition
    # over the longer known sequence; each draft is that sequence's head-m argmax at N.
    longer = torch.cat([ids, torch.tensor(drafts)])
    _, h0_long = model(longer)
    known = known_states(model, longer, h0_long)
    heads = model.mtp_logits(h0_long, longer)
    for m in range(1, k + 2):
        torch.testing.assert_close(chain[m - 1], known[m - 1][: N + 1], **TOL)
    for m in range(1, k + 1):
        if clear_argmax(heads[m - 1][N]):
            assert int(heads[m - 1][N].argmax()) == drafts[m - 1]
    # j accepted, then a different token: the new round's states equal the old ones wherever
    # every input is the same (head m at t <= N+1+j-m), for both rounds' heads.
    for j in range(k):
        wrong = 11 + (drafts[j] - 10) % 1000
        assert wrong != drafts[j]
        ids_j = torch.cat([ids, torch.tensor([*drafts[:j], wrong])])
        new_drafts = mtp.draft(model, ids_j, 8)
        new = mtp.head_states(model, ids_j, new_drafts[:7])
        for m in range(1, k + 2):
            last = min(N, N + 1 + j - m)
            torch.testing.assert_close(new[m - 1][: last + 1], chain[m - 1][: last + 1], **TOL)


@torch.no_grad()
def test_number_of_drafts_and_real_tokens_only():
    m = tiny_model()
    m.num_real_tokens = 500  # padded vocabulary rows are never drafted
    ids = prompt(12, seed=5, high=500)
    assert mtp.draft(m, ids, 0) == []
    for k in (1, 3, 8):
        d = mtp.draft(m, ids, k)
        assert len(d) == k and all(0 <= t < 500 for t in d)
    full = mtp.draft(m, ids, 8)
    assert mtp.draft(m, ids, 3) == full[:3]  # a shorter chain is a prefix of the longer one
    with pytest.raises(ValueError, match="0..8"):
        mtp.draft(m, ids, 9)
    with pytest.raises(ValueError, match="at least 2"):
        mtp.draft(m, ids[:1], 1)
    with pytest.raises(ValueError, match="need 2 drafts"):
        mtp.head_states(m, ids, [12], num_heads=3)


@torch.no_grad()
def test_deterministic(model):
    ids = prompt(14, seed=6)
    a = mtp.draft(model, ids, 8)
    b = mtp.draft(model, ids, 8)
    assert a == b
    s1 = mtp.head_states(model, ids, a[:7])
    s2 = mtp.head_states(model, ids, a[:7])
    assert all(torch.equal(x, y) for x, y in zip(s1, s2))
