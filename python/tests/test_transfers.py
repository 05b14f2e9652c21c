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
    # The planner's sources are readable, so none is overridden; its GPU sources are the chunks' sources.
    assert t["source_reasons"][:2] == ["planned", "split"]
    assert t["source_reason"].shape == (second.num_moves,) and (t["source_reason"] <= 1).all()
    first_row = {}
    for r in ch:
        first_row.setdefault((int(r[cols["layer"]]), int(r[cols["move"]])), r)
    offsets = np.concatenate([[0], np.cumsum(per_layer)])
    for (l, m), r in first_row.items():
        src = moves[offsets[l] + m, 2]
        if src >= 0 and r[cols["path"]] != 1:
            assert r[cols["src_gpu"]] == src


def test_transfers_bad_input():
    first, second = two_plans()
    with pytest.raises(ValueError, match="expert_bytes must be positive"):
        second.transfers(first.placement, expert_bytes=0)
    other = foremoe.Planner(foremoe.Topology(1, 2, 8)).plan(np.ones((3, 16), dtype=np.int64))
    with pytest.raises(ValueError, match="resident placement is"):
        second.transfers(other.placement, expert_bytes=100)
    with pytest.raises(ValueError, match="has no source"):
        second.transfers(first.placement, expert_bytes=100, host_mirror=False, allow_network=False)


def move_defaults():
    """The move model's settings as `Plan.transfers(move=...)` takes them, defaults from the library's schema."""
    return {o["key"]: o["default"] for o in foremoe.options("move")}


def test_transfers_move_settings_price_the_moves():
    first, second = two_plans(seed=4)
    assert second.num_moves > 0
    B = 3 * 2048 * 768 * 2
    d = move_defaults()
    assert set(d) >= {"move_intra_gb_per_s", "move_inter_gb_per_s", "move_host_gb_per_s", "pcie_ingress_gb_per_s"}
    base = second.transfers(first.placement, expert_bytes=B)["est_seconds"]
    # None, {} and the defaults spelled out are the same model.
    np.testing.assert_array_equal(second.transfers(first.placement, expert_bytes=B, move={})["est_seconds"], base)
    np.testing.assert_array_equal(second.transfers(first.placement, expert_bytes=B, move=d)["est_seconds"], base)
    # No fixed latencies: every link k times slower makes every layer's modelled time exactly k times longer.
    fast = {k: (0.0 if k.endswith("latency_us") else v) for k, v in d.items()}
    k = 4.0
    slow = {key: (v if key.endswith("latency_us") else v / k) for key, v in fast.items()}
    t_fast = second.transfers(first.placement, expert_bytes=B, move=fast)
    t_slow = second.transfers(first.placement, expert_bytes=B, move=slow)
    moved = t_fast["path_bytes"].sum(axis=1) > 0
    assert moved.any()
    np.testing.assert_allclose(t_slow["est_seconds"], k * t_fast["est_seconds"], rtol=1e-9)
    assert (t_fast["est_seconds"][moved] > 0).all()
    np.testing.assert_array_equal(t_slow["path_bytes"], t_fast["path_bytes"])
    # One slower link: never faster, and slower where that path carries bytes.
    net = dict(fast, move_inter_gb_per_s=fast["move_inter_gb_per_s"] / 10, pcie_ingress_gb_per_s=1e3)
    t_net = second.transfers(first.placement, expert_bytes=B, move=net)
    assert (t_net["est_seconds"] >= t_fast["est_seconds"] * (1 - 1e-12)).all()


def test_transfers_move_settings_bad_values_name_the_key():
    first, second = two_plans()
    with pytest.raises(ValueError, match=r"^transfers\.move\.move_inter_gb_per_s: must be in \[.*\], got -1$"):
        second.transfers(first.placement, expert_bytes=100, move={"move_inter_gb_per_s": -1})
    with pytest.raises(ValueError, match=r"^transfers\.move\.move_host_latency_us: expected a number, got \"x\"$"):
        second.transfers(first.placement, expert_bytes=100, move={"move_host_latency_us": "x"})
    with pytest.raises(ValueError, match=r"^transfers\.move: unknown key 'move_gb_per_s' \(known: move_intra_gb_per_s"):
        second.transfers(first.placement, expert_bytes=100, move={"move_gb_per_s": 10})
    with pytest.raises(ValueError, match=r"^transfers\.move\.pcie_ingress_gb_per_s: nan is not a finite number"):
        second.transfers(first.placement, expert_bytes=100, move={"pcie_ingress_gb_per_s": float("nan")})


def test_transfers_move_settings_match_the_cli(cli, tmp_path):
    """The same settings give `foremoe plan --expert-bytes ... --move-*` the same modelled times (micro-step 1, whose
    moves start from micro-step 0's placement in both)."""
    import json
    import subprocess

    rng = np.random.default_rng(7)
    loads = (300 * rng.lognormal(0, 1.2, size=(2, 3, 16))).astype(np.int64)
    np.save(tmp_path / "l.npy", loads)
    B, C = 3 * 2048 * 768 * 2, 1 << 20
    move = {"move_inter_gb_per_s": 7.5, "move_intra_gb_per_s": 90, "move_host_latency_us": 40,
            "pcie_ingress_gb_per_s": 30}
    flags = {o["key"]: o["flag"] for o in foremoe.options("move")}
    args = [cli, "plan", "--loads", str(tmp_path / "l.npy"), "--nodes", "2", "--gpus-per-node", "4", "--slots", "3",
            "--expert-bytes", str(B), "--max-chunk-bytes", str(C), "--out", str(tmp_path / "p.json")]
    for k, v in move.items():
        args += [f"--{flags[k]}", str(v)]
    subprocess.run(args, check=True, capture_output=True)
    ref = json.loads((tmp_path / "p.json").read_text())["micro_steps"][1]["layers"]
    plans = foremoe.Planner(foremoe.Topology(2, 4, 3)).plan(loads)
    got = plans[1].transfers(plans[0].placement, expert_bytes=B, max_chunk_bytes=C, move=move)
    default = plans[1].transfers(plans[0].placement, expert_bytes=B, max_chunk_bytes=C)
    want = np.array([lay["transfers"]["est_seconds"] for lay in ref])
    np.testing.assert_allclose(got["est_seconds"], want, rtol=1e-12)
    assert plans[1].num_moves > 0 and not np.allclose(default["est_seconds"], want)
