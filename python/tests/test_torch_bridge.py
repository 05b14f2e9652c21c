"""foremoe.torch.TransferEngine(group=...): the engine's paired transfers over a gloo process group, one engine per
rank (2 and 4 spawned processes). A plan's moves of one layer land with exact bytes and the engine's verification
on every rank; a rank that aborts its batch makes the others fail at once, naming its GPU; a rank that never
submits ends the others' wait timed_out at their deadline, naming the GPU and the deadline; a group whose size
disagrees with the topology is refused naming both."""

import json
import os
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="skipped: PyTorch (torch) is not installed; foremoe.torch needs it")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("skipped: this torch build has no torch.distributed gloo backend", allow_module_level=True)

import torch.distributed as dist  # noqa: E402

import foremoe  # noqa: E402
import torch_moe_cases as tc  # noqa: E402
from foremoe.torch import engine as fe  # noqa: E402

SLOTS, ROW = 3, 5000  # slots per GPU, bytes per expert (two tensors with a gap between them)
TENSORS = [(0, 2000), (2048, ROW - 2048)]


def expert_bytes(seed, num_experts):
    return np.random.default_rng(seed).integers(0, 256, (num_experts, ROW), dtype=np.uint8)


def initial_placement(plan, layer):
    """Every slot the plan's layer-`layer` moves do not write was in place before them."""
    before = np.array(plan.gpu_slots[layer], dtype=np.int32)
    for _, _, _, g, s in np.asarray(plan.moves)[np.asarray(plan.moves)[:, 0] == layer]:
        before[g, s] = -1
    return before


class Rank:
    """This rank's GPU slots, registered with an engine over the default group."""

    def __init__(self, world, seed, verify=True, bridge_timeout=30.0, num_experts=None):
        self.rank, self.world = dist.get_rank(), world
        self.topo = foremoe.Topology(1, world, SLOTS)
        self.E = num_experts or 2 * world
        self.ref = expert_bytes(seed, self.E)
        self.slots = torch.full((SLOTS, ROW), 0xEE, dtype=torch.uint8)
        self.engine = fe.TransferEngine(topology=self.topo, num_experts=self.E, tensors=TENSORS, verify=verify,
                                        host_mirror=False, max_chunk_bytes=1024, align_bytes=256,
                                        group=dist.group.WORLD, bridge_timeout=bridge_timeout)
        self.engine.register_slots(0, self.rank, self.slots)

    def place(self, gpu_slots):
        for s, e in enumerate(np.asarray(gpu_slots)[self.rank]):
            if e >= 0:
                for off, n in TENSORS:
                    self.slots[s, off:off + n] = torch.from_numpy(self.ref[e, off:off + n].copy())
        self.engine.set_resident(0, np.asarray(gpu_slots))

    def holds(self, s, e):
        got = self.slots[s].numpy()
        return all(np.array_equal(got[off:off + n], self.ref[e, off:off + n]) for off, n in TENSORS)


def moves_rank(rank, world, tmp):
    """Several plans' moves of one layer, in order (later moves read what earlier ones wrote on other ranks)."""
    tc.init_group(rank, world, tmp)
    rng = np.random.default_rng(world)
    r = Rank(world, seed=11)
    loads = np.stack([rng.multinomial(4000, rng.dirichlet(np.full(r.E, 0.3)))[None, :] for _ in range(4)])
    plans = foremoe.Planner(r.topo).plan(loads.astype(np.int64))
    r.place(initial_placement(plans[0], 0))
    remote = 0
    for k, plan in enumerate(plans):
        t = r.engine.submit(plan, 0, timeout=30.0)
        if k == 1:  # a Python thread that polls, holding the GIL between polls, does not starve the bridge
            while not t.poll():
                pass
        t.wait(timeout=60.0)
        tel = t.telemetry()
        moves = np.asarray(plan.moves)
        moves = moves[moves[:, 0] == 0]
        assert len(tel) == len(moves)
        for (_, e, _, g, s), m in zip(moves.tolist(), tel):
            if g == rank:  # landed here, checksum-verified against the sender's header
                assert m["ok"] and m["verified"], m
                assert r.engine.valid_expert(0, g, s) == e
            remote += m["remote"]
        want = np.asarray(plan.gpu_slots[0])[rank]
        for s, e in enumerate(want):
            assert r.engine.resident(0)[rank, s] == e
            if e >= 0:
                assert r.holds(s, int(e)), f"rank {rank} slot {s}: wrong bytes for expert {e}"
    r.engine.close()
    total = torch.tensor([remote])
    dist.all_reduce(total)
    assert int(total) > 0, "no move crossed ranks"
    dist.barrier()
    dist.destroy_process_group()


def errors_rank(rank, tmp):
    """Two ranks: bad input, a rank that aborts, then a rank that never submits (last: gloo closes the connection
    whose wait timed out)."""
    tc.init_group(rank, 2, tmp)
    out = {}
    # A group whose size disagrees with the topology.
    try:
        fe.TransferEngine(topology=foremoe.Topology(1, 3, SLOTS), num_experts=4, expert_bytes=64,
                          group=dist.group.WORLD)
        out["bad"] = "no error"
    except ValueError as e:
        out["bad"] = str(e)
    # Rank 1 aborts its batch (its gate never opens); rank 0 must fail at once, naming GPU 1.
    r = Rank(2, seed=3, num_experts=3)
    placement = np.array([[0, -1, -1], [1, 2, -1]], dtype=np.int32)
    r.place(placement)
    moves = np.array([[1, 1, 0, 1], [2, 1, 0, 2]], dtype=np.int32)  # GPU 1's experts 1, 2 into GPU 0
    dist.barrier()
    t0 = time.monotonic()
    if rank == 1:
        never = fe.HostEvent()
        t = r.engine.submit(moves, 0, slots_free=never, timeout=20.0)
        time.sleep(0.3)
        t.abort()
        out["abort_state"] = t.state if _raises(t, fe.TransferError) else "no error"
    else:
        t = r.engine.submit(moves, 0, timeout=20.0)
        try:
            t.wait(timeout=30.0)
            out["abort"] = "no error"
        except fe.TransferError as e:
            out["abort"] = str(e)
            out["abort_code"] = e.code
        out["abort_seconds"] = time.monotonic() - t0
        out["abort_valid"] = [r.engine.valid_expert(0, 0, s) for s in range(SLOTS)]
    r.engine.close()
    dist.barrier()
    # Rank 1 never submits: rank 0's wait ends timed_out at its 0.5 s deadline, naming GPU 1.
    r = Rank(2, seed=4, num_experts=3, bridge_timeout=2.0)
    r.place(placement)
    if rank == 0:
        t0 = time.monotonic()
        t = r.engine.submit(moves, 0, timeout=0.5)
        try:
            t.wait(timeout=10.0)
            out["timeout"] = "no error"
        except fe.TransferError as e:
            out["timeout"] = str(e)
            out["timeout_code"] = e.code
        out["timeout_seconds"] = time.monotonic() - t0
        t0 = time.monotonic()
        r.engine.close()  # waits for the bridge's own 2 s deadline on the exchange it still runs
        out["close_seconds"] = time.monotonic() - t0
    else:
        time.sleep(3.0)
        r.engine.close()
    with open(f"{tmp}/rank{rank}.json", "w") as f:
        json.dump(out, f)
    # No collective after a bridge timeout: gloo closes the pair whose wait timed out ("Application timeout caused
    # pair closure"), so the group is unusable from here on, as an aborted NCCL communicator would be.


def dead_peer_rank(rank, tmp):
    """Rank 1's process ends without submitting: rank 0 fails long before its deadline, naming rank 1."""
    tc.init_group(rank, 2, tmp)
    r = Rank(2, seed=5, num_experts=3, bridge_timeout=60.0)
    r.place(np.array([[0, -1, -1], [1, 2, -1]], dtype=np.int32))
    dist.barrier()
    if rank == 1:
        os._exit(0)
    time.sleep(0.5)
    t0 = time.monotonic()
    t = r.engine.submit(np.array([[1, 1, 0, 1]], dtype=np.int32), 0, timeout=60.0)
    out = {}
    try:
        t.wait(timeout=90.0)
        out["error"] = "no error"
    except fe.TransferError as e:
        out["error"], out["code"] = str(e), e.code
    out["seconds"] = time.monotonic() - t0
    r.engine.close()
    with open(f"{tmp}/rank0.json", "w") as f:
        json.dump(out, f)


KINDS = [(torch.float32, (500,)), (torch.bfloat16, (3, 492))]  # per-kind rows of 2000 and 2952 bytes


def split_rank(rank, tmp):
    """Two ranks, per-kind slot tensors and per-kind mirror views inside one node-shared segment, under injected
    faults with verification: every move lands exact bytes or fails cleanly, and receivers whose paired transfer
    failed (or did not verify) land from the node's mirror, which telemetry reports as ``fallback``."""
    from foremoe import _core

    tc.init_group(rank, 2, tmp)
    E, L = 4, 12  # one layer per batch: every placement is declared before any batch runs
    sizes = [int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size() for dtype, shape in KINDS]
    ref = [np.random.default_rng(k).integers(0, 256, (E, n), dtype=np.uint8) for k, n in enumerate(sizes)]
    offsets = [0, (E * sizes[0] + 63) // 64 * 64]
    payload = offsets[1] + E * sizes[1]
    key = f"split-{os.path.basename(tmp)}"
    if rank == 0:
        seg = _core.NodeMirror.create(key, 0, 0, payload)
        seg.begin_refresh()
        seg.array()[:] = 0
        for k in range(2):
            seg.array()[offsets[k]:offsets[k] + E * sizes[k]] = ref[k].reshape(-1)
        seg.end_refresh()
    dist.barrier()
    if rank == 1:
        seg = _core.NodeMirror.open(key, 0, 0, payload)
    dist.barrier()
    if rank == 0:
        seg.unlink()
    base = torch.from_numpy(seg.array())
    views = [base[o:o + E * n].view(dtype).view((E,) + shape) for o, n, (dtype, shape) in zip(offsets, sizes, KINDS)]
    faults = fe.FaultSchedule(fail_probability=0.08, corrupt_probability=0.08, seed=17)
    eng = fe.TransferEngine(topology=foremoe.Topology(1, 2, SLOTS), num_layers=L, num_experts=E, tensors=sizes,
                            verify=True, max_attempts=3, max_chunk_bytes=1024, align_bytes=256, faults=faults,
                            group=dist.group.WORLD, bridge_timeout=30.0)
    resident = np.array([[0, 1, -1], [2, 3, -1]], dtype=np.int32)
    slots = []
    for layer in range(L):
        mine = [torch.zeros((SLOTS,) + shape, dtype=dtype) for dtype, shape in KINDS]
        for s, e in enumerate(resident[rank]):
            for k, t in enumerate(mine):
                if e >= 0:
                    t[s].view(torch.uint8).view(-1)[:] = torch.from_numpy(ref[k][e])
        eng.register_slots(layer, rank, mine)
        eng.register_mirror(layer, 0, views, node_mirror=seg)
        eng.set_resident(layer, resident)
        slots.append(mine)
    moves = np.array([[2, 1, 0, 2], [0, 0, 1, 2], [3, 1, 0, 1]], dtype=np.int32)  # over the group both ways
    tickets = [eng.submit(moves, layer, timeout=30.0) for layer in range(L)]
    counts = torch.zeros(4, dtype=torch.int64)  # landed here, fallbacks, verify failures, failed moves
    for layer, t in enumerate(tickets):
        try:
            t.wait(timeout=60.0)
        except fe.TransferError as e:
            assert e.code == "device_error", str(e)
        for (e, _, g, s), m in zip(moves.tolist(), t.telemetry()):
            if g != rank:
                assert m["remote"] and not m["fallback"] and m["verify_failures"] == 0, m
                continue
            if m["ok"]:
                counts[0] += 1
                for k, tk in enumerate(slots[layer]):
                    got = np.from_dlpack(tk[s].view(torch.uint8).reshape(-1))
                    assert np.array_equal(got, ref[k][e]), f"rank {rank} layer {layer} slot {s} kind {k}"
                assert eng.valid_expert(layer, g, s) == e
            else:
                counts[3] += 1
                assert eng.valid_expert(layer, g, s) != e
            assert not m["fallback"] or m["ok"], m
            counts[1] += int(m["fallback"])
            counts[2] += m["verify_failures"]
    eng.close()
    dist.all_reduce(counts)
    with open(f"{tmp}/rank{rank}.json", "w") as f:
        json.dump(counts.tolist(), f)
    dist.barrier()
    dist.destroy_process_group()


GRAD_KINDS = [(5, 7), (11,)]  # per-kind gradient rows (elements)


def all_grads(seed, world, dtype):
    """Every rank's per-kind gradients ``[SLOTS, *shape]`` (each rank builds all of them from the seed)."""
    gen = torch.Generator().manual_seed(seed)
    return [[(torch.randn((SLOTS,) + shape, generator=gen, dtype=torch.float64)
              * torch.pow(2.0, torch.randint(-6, 7, (SLOTS,) + shape, generator=gen).double())).to(dtype)
             for shape in GRAD_KINDS] for _ in range(world)]


def grads_rank(rank, world, tmp):
    """Per-kind replica gradients over the group, layer 0 float64 and layer 1 bfloat16 (one dtype per layer): each
    owner row is its own gradient plus its replicas' in GPU order, added by torch one at a time, bit for bit."""
    tc.init_group(rank, world, tmp)
    E = 2 * world
    eng = fe.TransferEngine(topology=foremoe.Topology(1, world, SLOTS), num_layers=2, num_experts=E,
                            tensors=[64, 32], group=dist.group.WORLD, bridge_timeout=30.0)
    # Expert 2g (owned by GPU g, slot 0) and 2g+1 (GPU g, slot 1) are replicated on every other GPU in slot 2 in
    # turn: GPU g's slot 2 holds expert 2(g+1 mod world), so each owner has one replica on another rank.
    placement = np.array([[2 * g, 2 * g + 1, 2 * ((g + 1) % world)] for g in range(world)], dtype=np.int32)
    owners = [e // 2 for e in range(E)]
    layers = {0: torch.float64, 1: torch.bfloat16}
    mine, ref = {}, {}
    for layer, dtype in layers.items():
        ref[layer] = all_grads(7 + layer, world, dtype)
        mine[layer] = [t.clone() for t in ref[layer][rank]]
        eng.register_grads(layer, rank, mine[layer])
        eng.set_resident(layer, placement)
    for layer in layers:
        eng.submit_reduce(layer, owners, timeout=30.0).wait(timeout=60.0)
    for layer in layers:
        for k in range(len(GRAD_KINDS)):
            e = 2 * rank  # owned here in slot 0, replicated on GPU rank-1's slot 2
            want = ref[layer][rank][k][0].clone()
            for g in range(world):
                if g != rank and placement[g, 2] == e:
                    want += ref[layer][g][k][2]
            got = mine[layer][k][0]
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (rank, layer, k)
            assert not torch.equal(got, ref[layer][rank][k][0])  # something was added
            assert torch.equal(mine[layer][k][1], ref[layer][rank][k][1])  # expert 2r+1 has no replica
            assert torch.equal(mine[layer][k][2], ref[layer][rank][k][2])  # a replica's row is left as it is
    eng.close()
    dist.barrier()
    dist.destroy_process_group()


def _raises(t, kind):
    try:
        t.wait(timeout=10.0)
    except kind:
        return True
    return False


@pytest.mark.parametrize("world", [2, 4])
def test_plan_moves_land_over_the_group(tmp_path, world):
    tc.run_ranks(moves_rank, world, (world, str(tmp_path)), str(tmp_path), timeout=240.0)


def test_errors_over_the_group(tmp_path):
    tc.run_ranks(errors_rank, 2, (str(tmp_path),), str(tmp_path), timeout=240.0)
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    assert "2 ranks" in r0["bad"] and "3 GPUs" in r0["bad"], r0["bad"]
    assert r1["abort_state"] == "aborted"
    assert r0["abort_code"] == "device_error" and "GPU 1 sent no valid copy" in r0["abort"], r0["abort"]
    assert r0["abort_seconds"] < 10.0  # long before the 20 s deadline
    assert r0["abort_valid"] == [0, -1, -1]
    assert r0["timeout_code"] == "timed_out", r0["timeout"]
    assert "waiting on GPU 1" in r0["timeout"] and "deadline 500 ms" in r0["timeout"], r0["timeout"]
    assert r0["timeout_seconds"] < 1.5
    assert r0["close_seconds"] < 5.0


def test_dead_peer_fails_before_the_deadline(tmp_path):
    tc.run_ranks(dead_peer_rank, 2, (str(tmp_path),), str(tmp_path), timeout=240.0)
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    assert r0["code"] == "device_error", r0
    assert "GPU 1" in r0["error"] and "rank 1" in r0["error"], r0["error"]
    assert r0["seconds"] < 30.0  # not the 60 s deadline


def test_per_kind_tensors_over_the_group_fall_back_to_the_node_mirror(tmp_path):
    tc.run_ranks(split_rank, 2, (str(tmp_path),), str(tmp_path), timeout=240.0)
    landed, fallbacks, verify_failures, failed = json.loads((tmp_path / "rank0.json").read_text())
    assert landed > 0 and fallbacks > 0, (landed, fallbacks, verify_failures, failed)
    assert verify_failures > 0, "no received copy was corrupted: the fault proved nothing"


@pytest.mark.parametrize("world", [2, 3])
def test_per_kind_gradients_reduce_over_the_group_bitwise(tmp_path, world):
    tc.run_ranks(grads_rank, world, (world, str(tmp_path)), str(tmp_path), timeout=240.0)
