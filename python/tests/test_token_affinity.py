"""Plan.dispatch(..., rule="node_affine"): the same counts and exchange as the positional rule, each rank's
tokens sent to copies on nodes they already visit, never more remote nodes per token in total."""

import numpy as np
import pytest

import foremoe


def remote_nodes(slots, rank, S, per_node):
    """Distinct nodes other than the rank's own that each token reaches, summed (counted here with sets)."""
    home = rank // per_node
    n = 0
    for row in slots:
        n += len({int(s) // S // per_node for s in row if s >= 0} - {home})
    return n


def case(seed, nodes=4, per_node=2, S=4, E=16, K=4, T=120):
    rng = np.random.default_rng(seed)
    G = nodes * per_node
    p = np.exp(1.5 * rng.standard_normal(E))
    ids = [rng.choice(E, size=(T, 1, K), p=p / p.sum()).astype(np.int32) for _ in range(G)]
    for x in ids:
        x[rng.random(x.shape) < 0.05] = -1
    src = np.zeros((E, G), np.int64)
    for r, x in enumerate(ids):
        v = x.ravel()
        src[:, r] = np.bincount(v[v >= 0], minlength=E)
    plan = foremoe.Planner(foremoe.Topology(nodes, per_node, S)).plan(src.sum(axis=1)[None])
    return plan, ids, plan.source_split(0, src)


@pytest.mark.parametrize("seed", range(6))
def test_node_affine_dispatch_keeps_the_exchange_and_cuts_nodes(seed):
    plan, ids, split = case(seed)
    G, S, per_node = plan.num_gpus, plan.slots, plan.topology.gpus_per_node
    p2l = np.asarray(plan.phys_to_log[0])
    pos_hits = aff_hits = 0
    for r, x in enumerate(ids):
        pos = plan.dispatch(0, x, split, r)
        aff = plan.dispatch(0, x, split, r, rule="node_affine")
        for key in ("input_splits", "output_splits", "slot_counts", "recv_perm", "recv_inverse"):
            np.testing.assert_array_equal(aff[key], pos[key])
        s, e = aff["slots"], x[:, 0, :]
        np.testing.assert_array_equal(s < 0, e < 0)
        np.testing.assert_array_equal(p2l[s[s >= 0]], e[e >= 0])  # each route on a copy of its expert
        np.testing.assert_array_equal(np.bincount(s[s >= 0], minlength=G * S), split[:, r])  # exact counts
        sent = s.reshape(-1)[aff["order"]]
        assert np.all(np.diff(sent) >= 0)
        np.testing.assert_array_equal(aff["send_tokens"], aff["order"] // x.shape[2])
        np.testing.assert_array_equal(plan.dispatch(0, x, split, r, rule="node_affine")["slots"], s)  # deterministic
        pos_hits += remote_nodes(pos["slots"], r, S, per_node)
        aff_hits += remote_nodes(s, r, S, per_node)
    assert aff_hits <= pos_hits


def test_node_affine_dispatch_cuts_nodes_somewhere():
    cuts = 0
    for seed in range(6):
        plan, ids, split = case(seed)
        S, per_node = plan.slots, plan.topology.gpus_per_node
        for r, x in enumerate(ids):
            pos = remote_nodes(plan.dispatch(0, x, split, r)["slots"], r, S, per_node)
            aff = remote_nodes(plan.dispatch(0, x, split, r, rule="node_affine")["slots"], r, S, per_node)
            cuts += aff < pos
    assert cuts > 0


def test_dispatch_rule_bad_name():
    plan, ids, split = case(0)
    with pytest.raises(ValueError, match="dispatch: rule must be one of positional, node_affine, got 'nearest'"):
        plan.dispatch(0, ids[0], split, 0, rule="nearest")
