import numpy as np
import pytest

import foremoe


def two_plans(seed=0, topo=foremoe.Topology(2, 4, 3), E=16, L=3):
    rng = np.random.default_rng(seed)
    planner = foremoe.Planner(topo)
    a = (300 * rng.lognormal(0, 1.2, size=(L, E))).astype(np.int64)
    b = (300 * rng.lognormal(0, 1.2, size=(L, E))).astype(np.int64)
    first = planner.plan(a)
    second = planner.plan(b, resident=first.placement)
    return first, second


@pytest.mark.parametrize("split", [True, False])
def test_transfers_cover_every_move_once_from_valid_sources(split):
    first, second = two_plans()
    B = 3 * 2048 * 768 * 2
    t = second.transfers(first.placement, expert_bytes=B, max_chunk_bytes=1 << 20, split_paths=split)
    cols = {c: i for i, c in enumerate(t["chunk_columns"])}
    ch = t["chunks"]
    assert ch.shape[1] == len(cols)
    moves = second.moves
    assert second.num_moves > 0
    before = first.phys_to_log  # [L, G*S]: the placement before the second micro-step
    for (l, m) in {(int(r[cols["layer"]]), int(r[cols["move"]])) for r in ch}:
        rows = ch[(ch[:, cols["layer"]] == l) & (ch[:, cols["move"]] == m)]
        covered = np.sort(rows[:, cols["offset_bytes"]])
        assert covered[0] == 0 and rows[:, cols["num_bytes"]].sum() == B
        for r in rows:
            if r[cols["path"]] != 1:  # a GPU source holds the expert before the micro-step
                assert before[l][r[cols["src_gpu"]] * 3 + r[cols["src_slot"]]] == r[cols["expert"]]
        if not split:
            assert len(set(rows[:, cols["path"]])) == 1
    per_layer = np.bincount(moves[:, 0], minlength=second.num_layers)
    got = np.array([len({int(r[1]) for r in ch if r[0] == l}) for l in range(second.num_layers)])
    np.testing.assert_array_equal(got, per_layer)
    assert (t["est_seconds"] >= t["link_bound_seconds"] * (1 - 1e-12)).all()
    assert t["path_bytes"].sum() == B * second.num_moves


def test_transfers_bad_input():
    first, second = two_plans()
    with pytest.raises(ValueError, match="expert_bytes must be positive"):
        second.transfers(first.placement, expert_bytes=0)
    other = foremoe.Planner(foremoe.Topology(1, 2, 8)).plan(np.ones((3, 16), dtype=np.int64))
    with pytest.raises(ValueError, match="resident placement is"):
        second.transfers(other.placement, expert_bytes=100)
    with pytest.raises(ValueError, match="has no source"):
        second.transfers(first.placement, expert_bytes=100, host_mirror=False, allow_network=False)
