"""foremoe.torch's node-shared host mirror (``mirror="node"``) on 4 gloo processes as 2 nodes x 2 local ranks.

Each local rank writes only its share of its node's mirror, yet every rank's mirror equals the per-rank mirror and
the full weights; the node pays the layer's weights once instead of once per local rank; with dropped moves the
fallback from the shared mirror gives exactly the fault-free run; a stale mirror (an optimizer step without a
refresh, or a refresh one local rank began alone) is refused; a segment of another size is refused on every rank
with a message naming both sizes; and nothing is left in /dev/shm."""

import gc
import os
from dataclasses import asdict

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="skipped: PyTorch (torch) is not installed; foremoe.torch needs it")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("skipped: this torch build has no torch.distributed gloo backend", allow_module_level=True)

import torch.distributed as dist  # noqa: E402
import torch_moe_cases as tc  # noqa: E402

import foremoe.torch as ft  # noqa: E402
from foremoe import _core  # noqa: E402

# 32 experts of 3 x 32 x 32 float64 (24 KiB each): one copy of the layer is 768 KiB, a whole number of pages.
G4 = tc.Case(world=4, experts=32, topk=4, hidden=32, ffn=32, nodes=2, dtype="float64", seed=12, steps=2)
DROPS = dict(seed=6, fail_probability=0.3, paired_only=True)  # transfers between ranks fail, host copies do not
RUNS = {
    "clean": dict(),
    "node_faults": dict(mirror="node", local_world=2, faults=DROPS),
    "rank_faults": dict(mirror=True, local_world=2, faults=DROPS),
    "node_stale": dict(mirror="node", local_world=2, skip_refresh=(0,)),
}
_runs = {}


def leftovers(pid: int):
    """Node mirror segments of the group whose rank 0 is process ``pid`` still in /dev/shm."""
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith(f"foremoe.{pid}-"))


def mirror_rank(rank: int, tmp: str) -> None:
    """Per-rank and node mirrors of the same layer side by side; writes what this rank saw."""
    tc.init_group(rank, G4.world, tmp)
    full = {n: getattr(tc.make_experts(G4), n).detach() for n in ft.SwiGLUExperts.weight_names}
    owners = ft.contiguous_owners(G4.experts, G4.world)
    mine = {n: w[torch.from_numpy(np.flatnonzero(owners == rank))].clone() for n, w in full.items()}
    per_rank = ft.ExpertStorage(mine, owners, G4.slots, rank=rank, world=G4.world, mirror=True, local_world=2)
    node = ft.ExpertStorage(mine, owners, G4.slots, rank=rank, world=G4.world, mirror="node", local_world=2)
    rec = {"share": (node.mirror.lo, node.mirror.hi)}

    def same(want):
        return {n: (torch.equal(node.mirror.tensors[n], w), torch.equal(per_rank.mirror.tensors[n], w),
                    torch.equal(node.mirror.tensors[n], per_rank.mirror.tensors[n])) for n, w in want.items()}

    rec["built"] = same(full)
    # An optimizer step's in-place update of every rank's owner weights: both mirrors are stale until refreshed.
    with torch.no_grad():
        for st in (per_rank, node):
            for p in st.params.values():
                p.add_(rank + 1.0)
    stepped = {n: w + torch.from_numpy(owners.astype(np.float64) + 1.0).reshape(-1, 1, 1) for n, w in full.items()}
    rec["stale_after_step"] = (per_rank.mirror_stale(), node.mirror_stale())
    per_rank.refresh_mirror()
    node.refresh_mirror()
    rec["refreshed"] = same(stepped)
    rec["stale_after_refresh"] = (per_rank.mirror_stale(), node.mirror_stale())
    rec["stats"] = (asdict(per_rank.mirror_stats()), asdict(node.mirror_stats()), asdict(ft.ExpertStorage(
        mine, owners, G4.slots, rank=rank, world=G4.world, local_world=2).mirror_stats()))
    # A refresh that rank 0 began alone (as if it died half-way): node 0's mirror is stale on both its ranks, node
    # 1's is not; the next collective refresh repairs it.
    dist.barrier()
    if rank == 0:
        node.mirror._m.begin_refresh()
    dist.barrier()
    rec["stale_interrupted"] = node.mirror_stale()
    rec["generation_interrupted"] = node.mirror_stats().generation
    node.refresh_mirror()
    rec["stale_repaired"] = node.mirror_stale()
    rec["generation_repaired"] = node.mirror_stats().generation
    rec["repaired"] = same(stepped)
    # bfloat16 weights (which gloo's collectives do not all take) travel as raw bytes.
    half = {n: w.to(torch.bfloat16) for n, w in mine.items()}
    bf16 = ft.ExpertStorage(half, owners, G4.slots, rank=rank, world=G4.world, mirror="node", local_world=2)
    rec["bf16"] = all(torch.equal(bf16.mirror.tensors[n], w.to(torch.bfloat16)) for n, w in full.items())
    del bf16
    # Rank 3 (node 1's second local rank) has other expert shapes: its node's segment has another size.
    bad = {n: torch.cat([w, w], dim=-1) for n, w in mine.items()} if rank == 3 else mine
    try:
        ft.ExpertStorage(bad, owners, G4.slots, rank=rank, world=G4.world, mirror="node", local_world=2)
        rec["mismatch"] = None
    except ValueError as e:
        rec["mismatch"] = str(e)
    del per_rank, node
    gc.collect()
    dist.barrier()
    rec["leftovers"] = leftovers(os.getpid()) if rank == 0 else []
    tc.save_and_leave(rec, tmp, rank)


def mirror_ranks(tmp_path_factory):
    if "mirror" not in _runs:
        tmp = str(tmp_path_factory.mktemp("node-mirror"))
        tc.run_ranks(mirror_rank, G4.world, (tmp,), tmp, timeout=120.0)
        _runs["mirror"] = [torch.load(f"{tmp}/rank{r}.pt") for r in range(G4.world)]
    return _runs["mirror"]


def training_runs(tmp_path_factory):
    if "train" not in _runs:
        tmp = str(tmp_path_factory.mktemp("node-mirror-train"))
        tc.run_ranks(tc.runs_rank, G4.world, (G4, list(RUNS.values()), tmp), tmp, timeout=180.0)
        recs = [torch.load(f"{tmp}/rank{r}.pt") for r in range(G4.world)]
        _runs["train"] = {k: [rec["runs"][i] for rec in recs] for i, k in enumerate(RUNS)}
    return _runs["train"]


def test_node_mirror_equals_the_per_rank_mirror(tmp_path_factory):
    ranks = mirror_ranks(tmp_path_factory)
    # Each local rank writes half of its node's experts ...
    assert [rec["share"] for rec in ranks] == [(0, 16), (16, 32), (0, 16), (16, 32)]
    for r, rec in enumerate(ranks):
        # ... and every rank sees all of them, equal to the full weights and to its per-rank mirror, after the
        # construction, after a refresh and after the repair of an interrupted refresh.
        for when in ("built", "refreshed", "repaired"):
            assert all(all(v) for v in rec[when].values()), (r, when, rec[when])
        assert rec["stale_after_step"] == (True, True), r
        assert rec["stale_after_refresh"] == (False, False), r
        assert rec["bf16"], r


def test_memory_per_node_is_one_copy(tmp_path_factory):
    payload = 32 * 3 * 32 * 32 * 8  # experts x kinds x H x F x float64
    for r, rec in enumerate(ranks := mirror_ranks(tmp_path_factory)):
        rank_mode, node_mode, none = rec["stats"]
        assert rank_mode == dict(mode="rank", local_world=2, node=r // 2, payload_bytes=payload,
                                 bytes_per_node=2 * payload, pinned=False, stale=False, generation=None)
        assert node_mode == dict(mode="node", local_world=2, node=r // 2, payload_bytes=payload,
                                 bytes_per_node=_core.node_mirror_segment_bytes(payload), pinned=False, stale=False,
                                 generation=4)
        # Half the per-rank total, plus the segment's header page.
        assert node_mode["bytes_per_node"] == rank_mode["bytes_per_node"] // 2 + 4096
        assert none["mode"] == "none" and none["bytes_per_node"] == 0
    assert len(ranks) == 4


def test_interrupted_refresh_makes_the_node_stale_until_refreshed(tmp_path_factory):
    ranks = mirror_ranks(tmp_path_factory)
    assert [rec["stale_interrupted"] for rec in ranks] == [True, True, False, False]
    assert [rec["generation_interrupted"] for rec in ranks] == [5, 5, 4, 4]  # odd: a refresh under way
    assert [rec["stale_repaired"] for rec in ranks] == [False] * 4
    assert [rec["generation_repaired"] for rec in ranks] == [6, 6, 6, 6]


def test_mismatched_segment_fails_every_rank_naming_the_sizes(tmp_path_factory):
    ranks = mirror_ranks(tmp_path_factory)
    payload = 32 * 3 * 32 * 32 * 8
    bigger = 32 * 3 * 32 * 64 * 8
    mine = ranks[3]["mismatch"]
    assert mine is not None and "node 1, local rank 1 of 2" in mine, mine
    assert f"holds {payload} payload bytes, this rank expects {bigger}" in mine, mine
    for r in range(3):
        assert "rank 3 could not map its node's mirror" in ranks[r]["mismatch"], ranks[r]["mismatch"]
    assert ranks[0]["leftovers"] == [], "a node mirror segment was left in /dev/shm"


def test_fallback_from_the_node_mirror_is_exact(tmp_path_factory):
    runs = training_runs(tmp_path_factory)
    ref = tc.reference(G4)
    for name in ("clean", "node_faults", "rank_faults"):
        assert not any(rec["errors"] for rec in runs[name]), name
        tc.assert_equals_reference(G4, runs[name], ref)
    syncs = [s for s in runs["node_faults"][0]["sync"]]
    faults = sum(s["faults"] for s in syncs)
    assert faults > 0 and sum(s["fallbacks"] for s in syncs) == faults, syncs
    # The same seeded drops and fallbacks as with per-rank mirrors, and bitwise the fault-free run.
    assert runs["node_faults"][0]["sync"] == runs["rank_faults"][0]["sync"]
    for clean, node in zip(runs["clean"], runs["node_faults"]):
        for key in ("out", "x_grad", "w_grad"):
            assert all(torch.equal(a, b) for a, b in zip(clean[key], node[key])), key
        for a, b in zip(clean["params"], node["params"]):
            assert all(torch.equal(a[n], b[n]) for n in a)


def test_stale_node_mirror_is_refused_until_refreshed(tmp_path_factory):
    ranks = training_runs(tmp_path_factory)["node_stale"]
    for rec in ranks:
        assert [(e["step"], e["micro"]) for e in rec["errors"]] == [(1, 0)]
        assert "older than the owner weights" in rec["errors"][0]["message"]
        assert "refresh_mirror()" in rec["errors"][0]["message"]
    tc.assert_equals_reference(G4, ranks, tc.reference(G4))


def small_storage(**options):
    full = {"w": torch.arange(4 * 3, dtype=torch.float32).reshape(4, 3)}
    return ft.ExpertStorage.from_full(full, [0, 0, 0, 0], 4, rank=0, world=1, **options), full


def test_engine_reads_a_node_segment_only_while_it_is_fresh():
    # 1 node x 2 GPUs x 2 slots, 3 experts of 256 bytes (expert e all e + 1); expert 1 on GPU 1, expert 2 only in
    # the segment. A refresh under way with wrong bytes must never reach a slot.
    import foremoe
    E, row = 3, 256
    seg = _core.NodeMirror.create(f"engine-{os.getpid()}", 0, 0, E * row)
    seg.unlink()
    payload = seg.array()
    seg.begin_refresh()
    payload[:] = np.repeat(np.arange(1, E + 1, dtype=np.uint8), row)
    seg.end_refresh()
    eng = ft.TransferEngine(topology=foremoe.Topology(1, 2, 2), num_layers=1, num_experts=E, tensors=[(0, row)])
    slots = [torch.zeros((2, row), dtype=torch.uint8) for _ in range(2)]
    for g in range(2):
        eng.register_slots(0, g, slots[g])
    with pytest.raises(ValueError, match="expected a foremoe._core.NodeMirror, got ndarray"):
        eng.register_node_mirror(0, 0, payload)
    eng.register_node_mirror(0, 0, seg)
    resident = np.array([[-1, -1], [1, -1]], dtype=np.int32)
    slots[1][0].fill_(2)

    def move(expert):
        slots[0][0].zero_()
        eng.set_resident(0, resident)
        eng.submit(np.array([[expert, -1, 0, 0]]), 0).wait()

    move(2)
    assert bool((slots[0][0] == 3).all())
    seg.begin_refresh()
    payload[row:] = 0xAB  # experts 1 and 2 half refreshed
    with pytest.raises(ValueError, match="no source|host mirror|mirror"):
        move(2)  # only the stale segment holds it
    assert bool((slots[0][0] == 0).all())
    move(1)  # from GPU 1 alone
    assert bool((slots[0][0] == 2).all())
    seg.end_refresh()
    move(2)
    assert bool((slots[0][0] == 0xAB).all())


def test_node_mirror_in_one_process():
    st, full = small_storage(mirror="node")
    stats = st.mirror_stats()
    assert (stats.mode, stats.local_world, stats.node, stats.payload_bytes) == ("node", 1, 0, 48)
    assert stats.bytes_per_node == 2 * 4096 and stats.generation == 2 and not stats.stale
    assert torch.equal(st.mirror.tensors["w"], full["w"])
    with torch.no_grad():
        st.params["w"].mul_(2.0)
    assert st.mirror_stale()
    st.refresh_mirror()
    assert torch.equal(st.mirror.tensors["w"], 2.0 * full["w"]) and st.mirror_stats().generation == 4


@pytest.mark.parametrize("options, message", [
    (dict(mirror="bogus"), "mirror must be False, True (one per rank), 'rank' or 'node' (one per node), got 'bogus'"),
    (dict(mirror=1), "got 1"),
    (dict(mirror="node", local_world=2), "local_world ranks per node must be positive and divide the group's 1"),
    (dict(mirror=True, local_world=0), "local_world ranks per node must be positive"),
])
def test_bad_mirror_options_are_named(options, message):
    with pytest.raises(ValueError) as e:
        small_storage(**options)
    assert message in str(e.value)


def test_local_world_from_the_environment(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "x")
    with pytest.raises(ValueError, match=r"LOCAL_WORLD_SIZE='x' is not an integer"):
        small_storage(mirror="node")
    small_storage()  # without a mirror the variable is not read
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(ValueError, match=r"LOCAL_WORLD_SIZE=3 ranks per node must be positive and divide"):
        small_storage(mirror=True)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert small_storage(mirror=True)[0].mirror_stats().local_world == 1


def test_segments_of_another_size_or_program_are_refused():
    key = f"pytest-{os.getpid()}"
    made = _core.NodeMirror.create(key, 0, 0, 100)
    with pytest.raises(ValueError, match=r"holds 100 payload bytes, this rank expects 200"):
        _core.NodeMirror.open(key, 0, 0, 200)
    view = _core.NodeMirror.open(key, 0, 0, 100).array()
    made.array()[7] = 9
    assert view[7] == 9  # two mappings of one segment
    del made
    assert leftovers_named(key) == []  # the creator removed the name; the other mapping still works
    assert view[7] == 9
    with open(f"/dev/shm/foremoe.{key}.n0.l1", "wb") as f:  # left over by another program
        f.write(b"x" * 8192)
    try:
        with pytest.raises(ValueError, match=r"is not a foremoe node mirror \(magic 0x7878787878787878"):
            _core.NodeMirror.open(key, 0, 1, 100)
        with pytest.raises(ValueError, match=r"exists already"):
            _core.NodeMirror.create(key, 0, 1, 100)
    finally:
        os.unlink(f"/dev/shm/foremoe.{key}.n0.l1")
    with pytest.raises(ValueError, match=r"job_key 'a b' has ' ' at index 1"):
        _core.NodeMirror.create("a b", 0, 0, 100)
    with pytest.raises(ValueError, match=r"payload_bytes must be positive, got 0"):
        _core.NodeMirror.create(key, 0, 0, 0)


def leftovers_named(key: str):
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith(f"foremoe.{key}."))
