import numpy as np
import pytest

import foremoe


def routed(seed=0, T=600, L=3, K=4, E=24, dtype=np.int32):
    rng = np.random.default_rng(seed)
    p = np.exp(1.5 * rng.standard_normal(E))
    ids = np.stack([rng.choice(E, size=(T, K), p=p / p.sum()) for _ in range(L)], axis=1)
    ids[rng.random(ids.shape) < 0.05] = -1
    return ids.astype(dtype)


def plan_for(ids, E, topo=foremoe.Topology(2, 2, 8)):
    loads = foremoe.count_loads(ids, num_experts=E)
    return foremoe.Planner(topo).plan(loads[0])


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16])
def test_map_tokens_follows_the_split(dtype):
    E = 24
    ids = routed(dtype=dtype)
    p = plan_for(ids, E)
    slots = p.map_tokens(ids)
    assert slots.shape == ids.shape and slots.dtype == np.int32
    wide = ids.astype(np.int64)
    if np.dtype(dtype).kind == "u":
        wide[wide == np.iinfo(dtype).max] = -1
    np.testing.assert_array_equal(slots < 0, wide < 0)
    for l in range(p.num_layers):
        s, e = slots[:, l].ravel(), wide[:, l].ravel()
        # Every routed id lands on a slot hosting its expert, and each slot gets exactly its planned tokens.
        np.testing.assert_array_equal(p.phys_to_log[l][s[s >= 0]], e[e >= 0])
        counts = np.bincount(s[s >= 0], minlength=p.num_gpus * p.slots)
        np.testing.assert_array_equal(counts, p.slot_tokens[l].ravel())
        # The i-th occurrence of an expert goes to the copy whose prefix range holds i.
        for ex in np.unique(e[e >= 0]):
            copies = p.log_to_phys[l][p.log_to_phys_offsets[l][ex]:p.log_to_phys_offsets[l][ex + 1]]
            want = np.repeat(copies, p.slot_tokens[l].ravel()[copies])
            np.testing.assert_array_equal(s[e == ex], want)
    np.testing.assert_array_equal(p.map_tokens(ids), slots)


def test_map_tokens_layer_map_and_strides():
    E = 16
    ids = routed(seed=3, L=2, E=E)
    p = plan_for(ids, E)
    trace = np.full((ids.shape[0], 3, ids.shape[2]), 99, dtype=ids.dtype)  # dense layer 0 holds junk
    trace[:, 1:] = ids
    slots = p.map_tokens(trace, layer_map=[-1, 0, 1])
    assert (slots[:, 0] == -1).all()
    np.testing.assert_array_equal(slots[:, 1:], p.map_tokens(ids))
    np.testing.assert_array_equal(p.map_tokens(np.asfortranarray(ids)), p.map_tokens(ids))


def test_map_tokens_bad_input():
    E = 8
    ids = routed(seed=1, L=1, E=E)
    p = plan_for(ids, E)
    bad = ids.copy()
    bad[0, 0, 0] = 77
    with pytest.raises(ValueError, match="expert id 77 at token 0, layer 0, k 0"):
        p.map_tokens(bad)
    other = ids.copy()
    e0 = other[other >= 0][0]
    other[other == e0] = -1  # expert e0 now has no routed tokens but the plan gives it some
    with pytest.raises(ValueError, match=f"expert {e0} has 0 routed tokens but the plan gives"):
        p.map_tokens(other)
    with pytest.raises(ValueError, match="MoE layers, the plan 1"):
        p.map_tokens(np.concatenate([ids, ids], axis=1))
    with pytest.raises(ValueError, match="int8, uint8"):
        p.map_tokens(ids.astype(np.float32))
