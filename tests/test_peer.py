"""Oracle (float64 mode) vs the peer, transformers' glm5_next run in float64 (docs/contract.md §9).

Tolerance belongs here and only here: both sides compute the same math in double, in different
orders, so they agree to ~1e-10 relative, not bit for bit.
"""
from __future__ import annotations

import numpy as np
import pytest

peer = pytest.importorskip("tests.peer")

import oracle  # noqa: E402
from oracle.capture import Capture  # noqa: E402
from oracle.layers.mhc import HyperConnection  # noqa: E402
from oracle.layers.ops import Precision  # noqa: E402

RTOL = 1e-10

CASES = {
    # layer 1 runs the indexer, layer 2 shares its selection; 28 tokens > index_topk = 8 so pools are dropped
    "indexer_drops": dict(seed=1, overrides={}, length=28),
    "groups": dict(seed=2, overrides=dict(n_group=4, topk_group=2), length=12),
    "dense_attention": dict(seed=3, overrides=dict(index_topk=64), length=20),
}


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


def prompt(vocab, n, seed):
    return [(seed * 31 + 17 * i * i + 5 * i) % vocab for i in range(n)]


@pytest.mark.parametrize("case", sorted(CASES))
def test_oracle_float64_matches_peer(tmp_path, case):
    spec = CASES[case]
    model_peer, path = peer.build_peer(tmp_path, spec["seed"], **spec["overrides"])
    ids = prompt(model_peer.config.vocab_size, spec["length"], spec["seed"])
    logits_peer, layers_peer = peer.run_peer(model_peer, ids)

    ours = oracle.load(path, precision="float64")
    cap = Capture(stages={"ffn_hc.streams", "mla.selected", "final_norm"})
    logits = ours.forward(ids, capture=cap)

    # the peer records each layer's input streams (embeddings first), then the final norm's output
    L = ours.config.num_hidden_layers
    assert len(layers_peer) == L + 1
    for l in range(L - 1):
        streams = np.stack([cap.get(l, "ffn_hc.streams", t) for t in range(len(ids))])
        err = rel_err(streams, layers_peer[l + 1])
        assert err <= RTOL, f"layer {l} streams differ from the peer: relative error {err:.3e}"
    final = np.stack([cap.get(L, "final_norm", t) for t in range(len(ids))])
    err = rel_err(final, layers_peer[L])
    assert err <= RTOL, f"final norm differs from the peer: relative error {err:.3e}"
    err = rel_err(logits, logits_peer)
    assert err <= RTOL, f"logits differ from the peer: relative error {err:.3e}"
    if case == "indexer_drops":
        last = cap.get(1, "mla.selected", len(ids) - 1)
        assert len(last) < len(ids), "the indexer was meant to drop positions in this case"


def test_hyper_connection_alone_matches_peer():
    torch = peer.torch
    cfg = peer.peer_config(hidden_size=40)
    module = peer.peer_mod.Glm5NextTextHyperConnection(cfg).to(torch.float64)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        module.fn.copy_(torch.randn(module.fn.shape, generator=g, dtype=torch.float64) * 0.3)
        module.base.copy_(torch.randn(module.base.shape, generator=g, dtype=torch.float64) * 0.5)
        module.scale.copy_(1 + 0.1 * torch.randn(3, generator=g, dtype=torch.float64))
    streams = torch.randn(1, 5, cfg.hc_mult, cfg.hidden_size, generator=g, dtype=torch.float64)
    with peer.peer_in_float64(), torch.no_grad():
        post_p, comb_p, collapsed_p = module(streams)

    hc = HyperConnection(module.fn.detach().numpy(), module.base.detach().numpy(),
                         module.scale.detach().numpy(), cfg)
    X = streams[0].numpy()
    pre, post, comb = hc.coefficients(X)
    collapsed = HyperConnection.collapse(Precision("float64"), X, pre)
    assert rel_err(post, post_p[0].numpy()) <= RTOL
    assert rel_err(comb, comb_p[0].numpy()) <= RTOL
    assert rel_err(collapsed, collapsed_p[0].numpy()) <= RTOL



LONG = 6000   # positions: a query at the end sees 1500 pools of 4 and keeps 512 (index_topk 2048)


def test_oracle_float64_matches_peer_at_long_context(tmp_path):
    """Several thousand positions with the real index_topk (2048) and k-pools of 4: most pools are
    dropped, so the selection decides most of what the late queries attend. The selection is a
    discontinuous function of the scores, and the two sides' scores agree to ~1e-16, not bit for bit:
    where a kept and a dropped score at a boundary are nearly equal the sides may keep different pools,
    both right. So the prompt is random tokens (a periodic one repeats pools), and the test checks that
    every boundary is either clear (1e-9 relative) or an exact tie at 0 (every head's relu 0, exact on
    both sides), which the peer's topk resolves by the canonical rule (peer.canonical_topk)."""
    model_peer, path = peer.build_peer(tmp_path, 4, index_topk=2048, index_kpool=4, index_n_heads=8,
                                       max_position_embeddings=8192)
    ids = [int(v) for v in np.random.default_rng(4).integers(0, model_peer.config.vocab_size, LONG)]
    with peer.canonical_topk():
        logits_peer, layers_peer = peer.run_peer(model_peer, ids)
    ours = oracle.load(path, precision="float64")
    cap = Capture(stages={"indexer.scores", "final_norm"})
    logits = ours.forward(ids, capture=cap)
    budget = 2048 // 4
    dropped, zero_ties, gap = 0, 0, np.inf
    for t in range(LONG):
        s = cap.get(1, "indexer.scores", t)
        if len(s) > budget:
            o = np.sort(s)[::-1]
            dropped += len(s) - budget
            if o[budget - 1] == o[budget] == 0:
                zero_ties += 1
            else:
                gap = min(gap, (o[budget - 1] - o[budget]) / max(abs(o[budget - 1]), 1e-300))
    assert len(cap.get(1, "indexer.scores", LONG - 1)) == LONG // 4 and dropped > 0
    assert zero_ties > 0, "no boundary falls on an exact tie: the case no longer exercises the tie rule"
    assert gap > 1e-9, f"a selection boundary is a near-tie ({gap:.2e}): pick another prompt"
    L = ours.config.num_hidden_layers
    final = np.stack([cap.get(L, "final_norm", t) for t in range(LONG)])
    assert rel_err(final, layers_peer[L]) <= RTOL
    err = rel_err(logits, logits_peer)
    assert err <= RTOL, f"logits differ from the peer: relative error {err:.3e}"
