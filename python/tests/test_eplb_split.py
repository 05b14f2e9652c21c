"""rebalance_experts(split="even"): never less balanced than DeepSeek EPLB under the even token split its callers
(vLLM, SGLang) apply, never two copies of an expert on one GPU, EPLB's output contract exactly.

The reference below is DeepSeek EPLB's algorithm, re-implemented here from its description (independently of the
library's C++ re-implementation): greedy replication by load per copy, balanced packing (items by weight,
descending, each to the lightest pack that still has room), hierarchical (groups to nodes, replicas inside each
node, the node's physical experts to its GPUs) when the groups divide over the nodes, else global.
FOREMOE_TEST_SEEDS=N runs N times as many random cases.

Where EPLB's placement holds two copies of one expert on a GPU, it splits that expert unevenly over GPUs, which no
placement without such pairs can; on small shapes that can reach a peak no duplicate-free placement reaches
(test_duplicate_free_cannot_always_match_eplb shows one exhaustively). So "never above EPLB" is asserted on every
layer where EPLB's placement has no duplicate (the search starts from it and never raises its peak) and on every
layer of shapes with at least 16 experts and at most half of them per GPU (DeepSeek-V3's 256 experts on 32-64 GPUs
are far inside). Elsewhere a bound of 10 % above EPLB's peak guards against regressions: in 24,000 random layers
the largest excess seen was 5.4 % (8 experts on 2 GPUs x 5 slots, where the result is the exhaustive
duplicate-free optimum), the next 1.1 %.
"""

import os
from pathlib import Path

import numpy as np
import pytest

import foremoe

# ---------------------------------------------------------------------------------------------------------------
# DeepSeek EPLB, as a reference.


def ref_replicate(w, num_physical):
    """Physical -> logical and copy counts: each extra copy to the expert with the largest load per copy."""
    n = w.size
    phy = list(range(n))
    cnt = np.ones(n)
    for _ in range(num_physical - n):
        e = int(np.argmax(w / cnt))  # first maximum on ties
        phy.append(e)
        cnt[e] += 1
    return np.array(phy, dtype=np.int64), cnt


def ref_balanced_packing(weights, num_packs):
    """Pack and rank in pack of every item; each pack gets len(weights) / num_packs items."""
    n = weights.size
    per_pack = n // num_packs
    if per_pack == 1:
        return np.arange(n), np.zeros(n, dtype=np.int64)
    pack = np.zeros(n, dtype=np.int64)
    rank = np.zeros(n, dtype=np.int64)
    load = np.zeros(num_packs)
    items = np.zeros(num_packs, dtype=np.int64)
    for i in np.argsort(-weights, kind="stable"):
        room = np.flatnonzero(items < per_pack)
        p = int(room[np.argmin(load[room])])  # the lightest pack with room, lowest index on ties
        pack[i] = p
        rank[i] = items[p]
        items[p] += 1
        load[p] += weights[i]
    return pack, rank


def ref_eplb_layer(w, num_physical, num_groups, num_nodes, num_gpus):
    """EPLB's phy2log for one layer."""
    E = w.size
    if num_groups % num_nodes:
        num_groups, num_nodes = 1, 1
    group_size, groups_per_node = E // num_groups, num_groups // num_nodes
    gpack, grank = ref_balanced_packing(w.reshape(num_groups, group_size).sum(axis=1), num_nodes)
    log2mlog = ((gpack * groups_per_node + grank)[:, None] * group_size + np.arange(group_size)).reshape(-1)
    mlog2log = np.empty(E, dtype=np.int64)
    mlog2log[log2mlog] = np.arange(E)
    per_node_phy, per_node_log, per_gpu = num_physical // num_nodes, E // num_nodes, num_physical // num_gpus
    phy2log = np.empty(num_physical, dtype=np.int64)
    for node in range(num_nodes):
        tokens = w[mlog2log[node * per_node_log:(node + 1) * per_node_log]]
        p2m, cnt = ref_replicate(tokens, per_node_phy)
        pack, rank = ref_balanced_packing(tokens[p2m] / cnt[p2m], num_gpus // num_nodes)
        phy2log[node * per_node_phy + pack * per_gpu + rank] = mlog2log[node * per_node_log + p2m]
    return phy2log


def ref_eplb(w, num_physical, num_groups, num_nodes, num_gpus):
    return np.stack([ref_eplb_layer(row, num_physical, num_groups, num_nodes, num_gpus) for row in w])


def even_split_gpu_loads(w, phy2log, num_gpus):
    """[L, G] GPU loads when every expert's tokens are split evenly over its copies (two copies on one GPU both
    count there, as in vLLM and SGLang)."""
    L, R = phy2log.shape
    E = w.shape[1]
    cnt = np.stack([np.bincount(r, minlength=E) for r in phy2log])
    per_slot = np.take_along_axis(w, phy2log, axis=1) / np.take_along_axis(cnt, phy2log, axis=1)
    return per_slot.reshape(L, num_gpus, R // num_gpus).sum(axis=2)


# ---------------------------------------------------------------------------------------------------------------
# The contract.


def check_contract(w, R, G, out):
    """EPLB's output contract exactly (also used by test_readers_eplb.py)."""
    phy2log, log2phy, logcnt = out
    L, E = w.shape
    S = R // G
    for a in out:
        assert isinstance(a, np.ndarray) and a.dtype == np.int64
    assert phy2log.shape == (L, R) and logcnt.shape == (L, E) and log2phy.shape == (L, E, int(logcnt.max()))
    assert (phy2log >= 0).all() and (phy2log < E).all()
    assert (logcnt >= 1).all() and (logcnt.sum(axis=1) == R).all(), "every expert needs a copy, every slot one"
    for l in range(L):
        np.testing.assert_array_equal(np.bincount(phy2log[l], minlength=E), logcnt[l])
        for e in range(E):
            c = logcnt[l, e]
            assert (log2phy[l, e, c:] == -1).all()
            p = log2phy[l, e, :c]
            assert (p >= 0).all() and (phy2log[l, p] == e).all() and (np.diff(p) > 0).all()
        rows = np.sort(phy2log[l].reshape(G, S), axis=1)
        assert (np.diff(rows, axis=1) > 0).all(), f"two copies of an expert on one GPU in layer {l}"


def _loads(rng, L, E):
    kind = rng.integers(4)
    if kind == 0:
        return rng.gamma(0.2 + 2 * rng.random(), 100.0, size=(L, E))
    if kind == 1:  # Zipf-like: load ~ 1 / rank^s over a random permutation
        s = 0.5 + 1.5 * rng.random()
        base = 1.0 / np.arange(1, E + 1) ** s
        return np.stack([rng.permutation(base) * 1e4 for _ in range(L)])
    if kind == 2:  # integer counts, ties included
        return rng.integers(0, 50, size=(L, E)).astype(np.float64) * rng.integers(1, 4, size=(L, E))
    w = rng.gamma(0.5, 10.0, size=(L, E))  # a few very hot experts on top of a flat load
    hot = rng.integers(0, E, size=(L, 2))
    for l in range(L):
        w[l, hot[l]] *= 20 + 60 * rng.random()
    return w


def _case(seed):
    rng = np.random.default_rng(1000 + seed)
    N = int(rng.choice([1, 1, 2, 4]))
    G = N * int(rng.choice([1, 2, 4, 8]))
    E = int(rng.choice([d for d in (8, 12, 16, 24, 32, 48, 64, 128) if d % N == 0]))
    S_min = -(-E // G)
    S = int(rng.integers(S_min, min(E, S_min * 4) + 1))
    R = G * S
    groups = int(rng.choice([d for d in (1, 2, 4, 8, 16) if E % d == 0]))
    L = int(rng.integers(1, 4)) if E <= 64 else 1
    return _loads(rng, L, E), R, groups, N, G


_SEEDS = 300 * max(1, int(os.environ.get("FOREMOE_TEST_SEEDS", "1") or 1))


def has_duplicate(phy2log, num_gpus):
    """[L] whether a GPU holds two copies of one expert."""
    L, R = phy2log.shape
    rows = np.sort(phy2log.reshape(L, num_gpus, R // num_gpus), axis=2)
    return (np.diff(rows, axis=2) == 0).any(axis=(1, 2))


@pytest.mark.parametrize("seed", range(_SEEDS))
def test_even_split_never_less_balanced_than_eplb(seed):
    w, R, groups, N, G = _case(seed)
    E, S = w.shape[1], R // G
    out = foremoe.rebalance_experts(w, R, groups, N, G)  # split="even" is the default
    check_contract(w, R, G, out)
    ours = even_split_gpu_loads(w, out[0], G).max(axis=1)
    eplb = ref_eplb(w, R, groups, N, G)
    theirs = even_split_gpu_loads(w, eplb, G).max(axis=1)
    strict = ~has_duplicate(eplb, G) | (E >= 16 and 2 * S <= E)
    tol = theirs * 1e-9 + 1e-12
    assert (ours[strict] <= theirs[strict] + tol[strict]).all(), (ours, theirs, strict)
    assert (ours <= theirs * 1.10 + tol).all(), (ours, theirs)


def test_duplicate_free_cannot_always_match_eplb():
    # 8 experts on 2 GPUs x 7 slots. Without duplicates every expert has 1 or 2 copies: 6 on both GPUs and one
    # single on each, so a GPU carries (total - wi - wj) / 2 + wi and the best peak is total / 2 + min |wi - wj| / 2
    # = 49.5 + 0.5. EPLB gives the hottest expert 3 copies, two on one GPU (2/3 of it there), and reaches 49.5.
    w = np.array([[5.0, 14, 18, 12, 10, 17, 7, 16]])
    total = w.sum()
    best_free = min((total - a - b) / 2 + max(a, b) for i, a in enumerate(w[0]) for b in w[0][i + 1:])
    assert best_free == 50.0
    eplb = ref_eplb(w, 14, 1, 1, 2)
    assert has_duplicate(eplb, 2)[0]
    assert even_split_gpu_loads(w, eplb, 2).max() == 49.5
    out = foremoe.rebalance_experts(w, 14, 1, 1, 2)
    check_contract(w, 14, 2, out)
    assert even_split_gpu_loads(w, out[0], 2).max() == best_free  # the duplicate-free optimum


def test_even_split_on_shapes_eplb_refuses():
    # 10 experts in 4 groups: EPLB's shape rules fail, the result still honours the contract
    w = np.random.default_rng(3).gamma(0.5, 10.0, size=(2, 10))
    out = foremoe.rebalance_experts(w, 12, 4, 2, 4)
    check_contract(w, 12, 4, out)


def test_even_split_hot_expert_on_every_gpu():
    # one expert carries nearly everything: it gets a copy on every GPU and no GPU holds it twice
    w = np.array([[1000.0, 1, 1, 1, 1, 1, 1, 1]])
    out = foremoe.rebalance_experts(w, 16, 1, 1, 4)
    check_contract(w, 16, 4, out)
    assert out[2][0, 0] == 4
    ours = even_split_gpu_loads(w, out[0], 4).max()
    assert ours <= even_split_gpu_loads(w, ref_eplb(w, 16, 1, 1, 4), 4).max() + 1e-9


def test_split_exact_and_unknown_split():
    w = np.random.default_rng(5).gamma(0.5, 10.0, size=(2, 16))
    exact = foremoe.rebalance_experts(w, 24, 2, 2, 4, split="exact")
    check_contract(w, 24, 4, exact)
    with pytest.raises(ValueError, match="'uneven'"):
        foremoe.rebalance_experts(w, 24, 2, 2, 4, split="uneven")


def _real_profiles():
    root = os.environ.get("FOREMOE_DATA_DIR")
    dirs = [Path(root)] if root else []
    dirs.append(Path(__file__).resolve().parents[3] / "shared" / "data")
    for d in dirs:
        files = sorted((d / "deepseek-v3-sglang").glob("*.npy")) if (d / "deepseek-v3-sglang").is_dir() else []
        if files:
            return files
    return []


@pytest.mark.parametrize("shape", [(32, 9, 4, 8), (64, 5, 8, 8)], ids=["32x9-4nodes", "64x5-8nodes"])
def test_even_split_real_deepseek_v3_profiles(shape):
    """Median over layers of max/mean GPU load under the even split, ours vs the reference EPLB, on SGLang's
    DeepSeek-V3 expert-load profiles (58 x 256; skipped when the data folder is absent)."""
    files = _real_profiles()
    if not files:
        pytest.skip("DeepSeek-V3 expert-load profiles not found (set FOREMOE_DATA_DIR)")
    G, S, N, groups = shape
    for f in files:
        w = np.load(f)
        out = foremoe.rebalance_experts(w, G * S, groups, N, G)
        check_contract(w, G * S, G, out)
        mean = w.sum(axis=1) / G
        ours = even_split_gpu_loads(w, out[0], G).max(axis=1) / mean
        theirs = even_split_gpu_loads(w, ref_eplb(w, G * S, groups, N, G), G).max(axis=1) / mean
        print(f"{f.stem} {G} GPUs x {S} slots, {N} nodes, {groups} groups: median max/mean "
              f"ours {np.median(ours):.4f} eplb {np.median(theirs):.4f}")
        assert (ours <= theirs * (1 + 1e-9)).all()
