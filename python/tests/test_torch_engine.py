"""foremoe.torch.engine: the runtime's transfer engine (host backend) on CPU torch tensors.

Moves from real plans land bitwise as a NumPy reference says, in several dtypes, in the tensors the caller
registered (no copies); tickets poll, wait with deadlines and abort; under the seeded fault injector every move
lands exactly or the batch fails with a clear error, and no slot the engine calls valid holds wrong bytes; bad
input is refused with a message naming it. Also the runtime's count_loads and map_tokens on CPU tensors."""

import time

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="skipped: PyTorch (torch) is not installed; foremoe.torch needs it")

import foremoe  # noqa: E402
from foremoe.torch import engine as fe  # noqa: E402

FILL = 0xEE  # bytes of slots nothing was written to yet


def byte_view(t):
    """The bytes of contiguous tensor `t` as a read-only NumPy array (sharing its memory when on the CPU)."""
    return np.from_dlpack(t.view(torch.uint8).cpu())


def write_bytes(t, index, data):
    """Writes NumPy `data` into the bytes of `t` at `index` (through torch: DLPack imports are read-only)."""
    t.view(torch.uint8)[index] = torch.from_dlpack(np.ascontiguousarray(data, dtype=np.uint8))


class Cluster:
    """Slots per (layer, GPU) and a mirror per (layer, node) as torch tensors of `dtype`, registered with an
    engine, plus the NumPy reference of what every slot must hold."""

    def __init__(self, topo, num_layers, num_experts, dtype, row_elems, *, seed=0, tensors=None, num_buffers=1,
                 device="cpu", **options):
        self.topo, self.L, self.E, self.num_buffers = topo, num_layers, num_experts, num_buffers
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.row_bytes = row_elems * itemsize
        self.tensors = tensors or [(0, self.row_bytes)]
        rng = np.random.default_rng(seed)
        G, S = topo.num_gpus, topo.slots
        self.mirror_ref = rng.integers(0, 256, (num_layers, num_experts, self.row_bytes), dtype=np.uint8)
        buf = (num_buffers,) if num_buffers == 2 else ()
        self.slots = [[torch.empty(buf + (S, row_elems), dtype=dtype, device=device) for _ in range(G)]
                      for _ in range(num_layers)]
        pinned = device != "cpu"
        self.mirrors = [[torch.empty((num_experts, row_elems), dtype=dtype, pin_memory=pinned)
                         for _ in range(topo.nodes)] for _ in range(num_layers)]
        for layer in range(num_layers):
            for g in range(G):
                self.slots[layer][g].view(torch.uint8).fill_(FILL)
            for n in range(topo.nodes):
                write_bytes(self.mirrors[layer][n], ..., self.mirror_ref[layer])
        self.ref = np.full((num_layers, G) + buf + (S, self.row_bytes), FILL, dtype=np.uint8)
        self.engine = fe.TransferEngine(topology=topo, num_layers=num_layers, num_experts=num_experts,
                                        tensors=self.tensors, **options)
        for layer in range(num_layers):
            for g in range(G):
                self.engine.register_slots(layer, g, self.slots[layer][g], num_buffers=num_buffers)
            for n in range(topo.nodes):
                self.engine.register_mirror(layer, n, self.mirrors[layer][n])

    def put(self, layer, g, s, e, buffer=0, ref_only=False):
        """Expert `e`'s tensors into slot (g, s): in the reference, and unless `ref_only` in the tensor too."""
        dst = self.ref[layer, g, buffer, s] if self.num_buffers == 2 else self.ref[layer, g, s]
        for off, n in self.tensors:
            dst[off:off + n] = self.mirror_ref[layer, e, off:off + n]
        if not ref_only:
            write_bytes(self.slots[layer][g], (buffer, s) if self.num_buffers == 2 else s, dst)

    def place(self, layer, gpu_slots):
        for g, row in enumerate(np.asarray(gpu_slots)):
            for s, e in enumerate(row):
                if e >= 0:
                    self.put(layer, g, s, int(e))
        self.engine.set_resident(layer, np.asarray(gpu_slots))

    def bytes(self, layer):
        return np.stack([byte_view(t) for t in self.slots[layer]])

    def holds(self, layer, g, s, e, buffer=0):
        got = self.bytes(layer)[g]
        got = got[buffer, s] if self.num_buffers == 2 else got[s]
        return all(np.array_equal(got[off:off + n], self.mirror_ref[layer, e, off:off + n]) for off, n in self.tensors)


def skewed_loads(rng, M, L, E):
    w = rng.dirichlet(np.full(E, 0.3), size=(M, L))
    return np.stack([[rng.multinomial(4000, w[m, l]) for l in range(L)] for m in range(M)]).astype(np.int64)


def initial_placement(plan, layer):
    """Micro-step 0 without a resident placement: every slot the plan's moves do not write was in place."""
    before = np.array(plan.gpu_slots[layer], dtype=np.int32)
    for _, _, _, g, s in np.asarray(plan.moves)[np.asarray(plan.moves)[:, 0] == layer]:
        before[g, s] = -1
    return before


@pytest.mark.parametrize("dtype,gap", [(torch.float32, 0), (torch.bfloat16, 96), (torch.float16, 0),
                                       (torch.float64, 40), (torch.int8, 0)])
def test_plan_moves_land_bitwise(dtype, gap):
    rng = np.random.default_rng(7 + gap)
    topo = foremoe.Topology(2, 2, 3)
    L, E, M = 2, 8, 4
    plans = foremoe.Planner(topo).plan(skewed_loads(rng, M, L, E))
    row_elems = 1536
    itemsize = torch.empty((), dtype=dtype).element_size()
    row = row_elems * itemsize
    # Two tensors per expert, with a gap between them the moves must leave alone.
    tensors = [(0, row // 3), (row // 3 + gap, row - row // 3 - gap)]
    c = Cluster(topo, L, E, dtype, row_elems, seed=int(rng.integers(1 << 30)), tensors=tensors,
                max_chunk_bytes=1024, align_bytes=256, verify=True)
    for layer in range(L):
        c.place(layer, initial_placement(plans[0], layer))
        assert np.array_equal(c.engine.resident(layer), initial_placement(plans[0], layer))
    num_moves = 0
    for plan in plans:
        for layer in range(L):
            t = c.engine.submit(plan, layer)
            t.wait(timeout=30.0)
            assert t.state == "done" and t.poll() is True
            moves = np.asarray(plan.moves)
            moves = moves[moves[:, 0] == layer]
            tel = t.telemetry()
            assert len(tel) == len(moves)
            for (_, e, _, g, s), m in zip(moves, tel):
                c.put(layer, int(g), int(s), int(e), ref_only=True)
                assert m["ok"] and m["verified"] and m["num_bytes"] == sum(n for _, n in tensors)
                assert c.engine.valid_expert(layer, int(g), int(s)) == e
            num_moves += len(moves)
            assert np.array_equal(c.bytes(layer), c.ref[layer]), f"layer {layer}: slot bytes differ from reference"
            # Every slot the plan fills holds its expert; the engine agrees.
            res = c.engine.resident(layer)
            placed = np.asarray(plan.gpu_slots[layer])
            assert np.all((placed < 0) | (res == placed))
    assert num_moves > 0, "the plans moved nothing: the test would prove nothing"
    assert c.engine.stats()["batches"] == M * L


def test_double_buffered_slots_write_the_asked_buffer():
    topo = foremoe.Topology(1, 2, 2)
    c = Cluster(topo, 1, 4, torch.float32, 300, num_buffers=2, seed=3)
    c.place(0, [[0, 1], [2, 3]])
    c.engine.submit([[0, -1, 1, 1], [3, -1, 0, 0]], 0, dst_buffer=1).wait(10.0)
    c.put(0, 1, 1, 0, buffer=1, ref_only=True)
    c.put(0, 0, 0, 3, buffer=1, ref_only=True)
    assert np.array_equal(c.bytes(0), c.ref[0])
    assert c.engine.valid_expert(0, 1, 1) == 0 and c.engine.valid_expert(0, 0, 0) == 3


def small(**options):
    """1 node x 2 GPUs x 2 slots, 4 experts: GPU 0 holds 0 and 1, GPU 1 holds 2 and 3."""
    c = Cluster(foremoe.Topology(1, 2, 2), 1, 4, torch.float32, 512, seed=1, **options)
    c.place(0, [[0, 1], [2, 3]])
    return c


def test_ticket_gate_poll_wait_deadline():
    c = small()
    gate = fe.HostEvent()
    t = c.engine.submit([[0, 0, 1, 1]], 0, slots_free=gate)  # expert 0 replaces expert 3 on GPU 1
    time.sleep(0.02)
    assert t.poll() is False and t.state == "pending"
    assert c.holds(0, 1, 1, 3) and c.engine.valid_expert(0, 1, 1) == 3  # nothing written before the gate
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="still running"):
        t.wait(timeout=0.05)
    assert time.monotonic() - t0 < 5.0
    assert t.state == "pending"  # a wait's deadline leaves the batch running
    gate.set()
    t.wait(timeout=10.0)
    assert t.poll() is True and t.state == "done"
    assert c.holds(0, 1, 1, 0) and c.engine.valid_expert(0, 1, 1) == 0

    # A gate that never opens: the batch's own deadline ends it; the slot keeps its old valid copy.
    t2 = c.engine.submit([[1, 0, 1, 0]], 0, slots_free=fe.HostEvent(), timeout=0.05)
    with pytest.raises(fe.TransferError) as err:
        t2.wait(timeout=10.0)
    assert err.value.code == "timed_out" and t2.state == "timed_out"
    with pytest.raises(fe.TransferError):
        t2.poll()
    assert c.engine.valid_expert(0, 1, 0) == 2 and c.holds(0, 1, 0, 2)


def test_abort_ends_the_batch_and_leaves_the_slot_invalid():
    c = small(faults=fe.FaultSchedule(delay_probability=1.0, delay_us=2_000_000, seed=1))
    t = c.engine.submit([[0, 0, 1, 1]], 0)
    time.sleep(0.01)
    t.abort()
    t0 = time.monotonic()
    with pytest.raises(fe.TransferError) as err:
        t.wait(timeout=10.0)
    assert time.monotonic() - t0 < 9.0
    assert err.value.code == "aborted" and t.state == "aborted"
    assert c.engine.valid_expert(0, 1, 1) == -1
    with pytest.raises(RuntimeError, match="host backend"):
        t.enqueue_wait(None)


def check_valid_bytes(c, layer):
    res = c.engine.resident(layer)
    for g, s in zip(*np.nonzero(res >= 0)):
        assert c.holds(layer, g, s, int(res[g, s])), f"GPU {g} slot {s} is valid for expert {res[g, s]} with " \
                                                     "wrong bytes"


def test_faults_exact_or_clear_error():
    topo = foremoe.Topology(2, 2, 3)
    L, E = 2, 8
    counts = {"ok": 0, "failed": 0, "retried": 0}
    for seed in range(10):
        rng = np.random.default_rng(100 + seed)
        plans = foremoe.Planner(topo).plan(skewed_loads(rng, 3, L, E))
        faults = fe.FaultSchedule(seed=seed, fail_probability=float(rng.uniform(0.05, 0.4)),
                                  corrupt_probability=float(rng.uniform(0, 0.3)),
                                  delay_probability=float(rng.uniform(0, 0.3)), delay_us=200)
        c = Cluster(topo, L, E, torch.bfloat16, 1024, seed=seed, faults=faults, verify=True,
                    max_attempts=int(rng.integers(1, 4)), max_chunk_bytes=512, align_bytes=256)
        for layer in range(L):
            c.place(layer, initial_placement(plans[0], layer))
        for plan in plans:
            for layer in range(L):
                t = c.engine.submit(plan, layer, timeout=20.0)
                t0 = time.monotonic()
                try:
                    t.wait(timeout=30.0)
                    counts["ok"] += 1
                except fe.TransferError as e:
                    assert e.code == "device_error" and t.state == "failed", str(e)
                    assert "move" in str(e) or "expert" in str(e), str(e)
                    counts["failed"] += 1
                assert time.monotonic() - t0 < 25.0
                moves = np.asarray(plan.moves)
                moves = moves[moves[:, 0] == layer]
                for (_, e, _, g, s), m in zip(moves, t.telemetry()):
                    counts["retried"] += m["attempts"] > m["num_chunks"]
                    assert (c.engine.valid_expert(layer, int(g), int(s)) == e) == m["ok"]
                    if m["ok"]:
                        assert c.holds(layer, int(g), int(s), int(e))
                check_valid_bytes(c, layer)
    assert counts["ok"] > 0 and counts["failed"] > 0 and counts["retried"] > 0, counts


def test_a_path_down_falls_back_to_the_mirror_exactly():
    topo = foremoe.Topology(1, 4, 3)
    rng = np.random.default_rng(5)
    plans = foremoe.Planner(topo).plan(skewed_loads(rng, 3, 1, 8))
    c = Cluster(topo, 1, 8, torch.float32, 2048, seed=5, faults=fe.FaultSchedule(fail_paths=["nvlink"], seed=5),
                max_attempts=2, max_chunk_bytes=2048, align_bytes=256)
    c.place(0, initial_placement(plans[0], 0))
    retried = 0
    for plan in plans:
        t = c.engine.submit(plan, 0)
        t.wait(timeout=30.0)
        moves = np.asarray(plan.moves)
        for (_, e, _, g, s), m in zip(moves, t.telemetry()):
            c.put(0, int(g), int(s), int(e), ref_only=True)
            assert m["ok"]
            retried += m["attempts"] > m["num_chunks"]
        assert np.array_equal(c.bytes(0), c.ref[0])
    assert retried > 0, "no chunk went over NVLink first: the fault proved nothing"


def test_bad_input_is_refused_with_a_clear_message():
    topo = foremoe.Topology(1, 2, 2)
    with pytest.raises(ValueError, match="unknown option 'num_expert'"):
        fe.TransferEngine(topology=topo, num_expert=4, expert_bytes=64)
    with pytest.raises(ValueError, match="num_experts must be positive"):
        fe.TransferEngine(topology=topo, num_experts=0, expert_bytes=64)
    with pytest.raises(ValueError, match="backend must be 'host' or 'cuda'"):
        fe.EngineOptions(backend="tpu")
    with pytest.raises(ValueError, match="fault probabilities"):
        fe.TransferEngine(topology=topo, num_experts=4, expert_bytes=64, faults=fe.FaultSchedule(fail_probability=2))
    if not fe.runtime_build_info()["cuda_compiled"]:
        with pytest.raises(RuntimeError, match="unavailable"):
            fe.TransferEngine(topology=topo, num_experts=4, expert_bytes=64, backend="cuda")

    eng = fe.TransferEngine(topology=topo, num_layers=1, num_experts=4, expert_bytes=256)
    good = torch.zeros(2, 64)
    with pytest.raises(ValueError, match=r"expected \[2, \.\.\.\]"):
        eng.register_slots(0, 0, torch.zeros(3, 64))
    with pytest.raises(ValueError, match="smaller than the 256 bytes"):
        eng.register_slots(0, 0, torch.zeros(2, 32))
    with pytest.raises(ValueError, match="contiguous"):
        eng.register_slots(0, 0, torch.zeros(2, 128)[:, ::2])
    with pytest.raises(ValueError, match="GPU 5 outside"):
        eng.register_slots(0, 5, good)
    with pytest.raises(ValueError, match="layer 1 outside"):
        eng.register_slots(1, 0, good)
    with pytest.raises(ValueError, match="must be a cpu tensor.*meta"):
        eng.register_slots(0, 0, torch.zeros(2, 64, device="meta"))
    with pytest.raises(TypeError, match="torch.Tensor"):
        eng.register_slots(0, 0, [[0.0] * 64] * 2)
    with pytest.raises(ValueError, match="float32, float64, bfloat16 or float16, got int32"):
        eng.register_grads(0, 0, torch.zeros(2, 64, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"expected \[4, \.\.\.\]"):
        eng.register_mirror(0, 0, torch.zeros(3, 64))
    eng.register_slots(0, 0, torch.zeros(2, 64, requires_grad=True))  # a parameter's memory: detached, not copied
    eng.register_mirror(0, 0, torch.zeros(4, 64))
    with pytest.raises(ValueError, match="GPU 1 has no registered slots"):
        eng.submit([[0, -1, 1, 0]], 0)
    with pytest.raises(ValueError, match=r"move 0 \(expert 9"):
        eng.submit([[9, -1, 0, 0]], 0)
    with pytest.raises(ValueError, match=r"dst_slot 2\) is outside"):
        eng.submit([[1, -1, 0, 2]], 0)
    with pytest.raises(ValueError, match="outside int32"):
        eng.submit(np.array([[1 << 33, -1, 0, 0]]), 0)
    with pytest.raises(ValueError, match=r"\[N, 4\]"):
        eng.submit([[1, -1, 0]], 0)
    with pytest.raises(ValueError, match="layer 3 outside"):
        eng.submit([[1, -1, 0, 0]], 3)
    with pytest.raises(ValueError, match="timeout must be positive"):
        eng.submit([[1, -1, 0, 0]], 0, timeout=0)
    with pytest.raises(TypeError, match="HostEvent or a torch.cuda.Event"):
        eng.submit([[1, -1, 0, 0]], 0, slots_free="now")
    with pytest.raises(ValueError, match="CUDA event handle, but the engine runs the host backend"):
        eng.submit([[1, -1, 0, 0]], 0, slots_free=1234)
    with pytest.raises(ValueError, match="holds expert 1 twice"):
        eng.set_resident(0, [[1, 1], [-1, -1]])
    with pytest.raises(ValueError, match=r"placement must be \[2, 2\]"):
        eng.set_resident(0, [[1, 2, 3]])
    other = foremoe.Planner(foremoe.Topology(1, 4, 2)).plan(np.full((1, 4), 10, dtype=np.int64))
    with pytest.raises(ValueError, match="the plan is 4 GPUs x 2 slots x 4 experts, the engine 2 x 2 x 4"):
        eng.submit(other, 0)
    with pytest.raises(ValueError, match="has no registered gradients"):
        eng.submit_reduce(0, [0, 0, 1, 1])


def test_replica_gradients_reduce_into_owners():
    topo = foremoe.Topology(1, 2, 2)
    eng = fe.TransferEngine(topology=topo, num_layers=1, num_experts=3, expert_bytes=64)
    slots = [torch.zeros(2, 16) for _ in range(2)]
    grads = [torch.arange(32, dtype=torch.float32).reshape(2, 16) + 100 * g for g in range(2)]
    for g in range(2):
        eng.register_slots(0, g, slots[g])
        eng.register_grads(0, g, grads[g])
    eng.set_resident(0, [[0, 1], [2, 0]])  # expert 0 owned by GPU 0 (slot 0), replicated on GPU 1 (slot 1)
    want = grads[0][0] + grads[1][1]
    eng.submit_reduce(0, [0, 0, 1]).wait(10.0)
    assert torch.equal(grads[0][0], want)


GRAD_KINDS = [(5, 7), (11,)]  # per-kind gradient rows (elements) of a split layout


def _kind_grads(seed, gpus, slots, dtype):
    """Every GPU's per-kind gradient tensors ``[slots, *shape]``, random values spanning several binades."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(gpus):
        out.append([(torch.randn((slots,) + shape, generator=gen, dtype=torch.float64)
                     * torch.pow(2.0, torch.randint(-6, 7, (slots,) + shape, generator=gen).double())).to(dtype)
                    for shape in GRAD_KINDS])
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16, torch.float32])
def test_per_kind_gradients_reduce_bitwise_in_the_fixed_order(dtype):
    """Split gradient regions (one tensor per weight kind) in each float dtype: every owner row is its own gradient
    plus its replicas' in GPU order, added by torch one at a time (bfloat16 / float16: float32 sums rounded to
    nearest even, as torch's add), bit for bit; held replicas stay, returned ones are zeroed."""
    topo = foremoe.Topology(1, 3, 3)
    eng = fe.TransferEngine(topology=topo, num_layers=1, num_experts=4, tensors=[64, 32])
    grads = _kind_grads(5, 3, 3, dtype)
    for g in range(3):
        eng.register_grads(0, g, grads[g])
    # Expert 0: owner GPU 0 slot 0, replicas on GPU 1 slot 1 and GPU 2 slot 2; expert 3: owner GPU 2 slot 0,
    # replica on GPU 0 slot 2; expert 1 on GPU 1 slot 0 and expert 2 on GPU 2 slot 1 without replicas.
    eng.set_resident(0, [[0, -1, 3], [1, 0, -1], [3, 2, 0]])
    owners = [0, 1, 2, 2]
    before = [[t.clone() for t in kinds] for kinds in grads]
    eng.submit_reduce(0, owners).wait(10.0)
    for k in range(len(GRAD_KINDS)):
        want0 = before[0][k][0].clone()
        want0 += before[1][k][1]  # replicas by GPU ascending
        want0 += before[2][k][2]
        assert torch.equal(grads[0][k][0].view(torch.uint8), want0.view(torch.uint8)), (dtype, k)
        want3 = before[2][k][0] + before[0][k][2]
        assert torch.equal(grads[2][k][0].view(torch.uint8), want3.view(torch.uint8)), (dtype, k)
        for g, s in [(1, 0), (2, 1), (1, 1), (2, 2), (0, 2)]:  # the others are left as they were
            assert torch.equal(grads[g][k][s].view(torch.uint8), before[g][k][s].view(torch.uint8))
    # The held-gradient rule with split regions: GPU 1's replica of expert 0 returns (added, zeroed), GPU 2's stays.
    before = [[t.clone() for t in kinds] for kinds in grads]
    held = -np.ones((3, 4), dtype=np.int32)
    held[2, 0] = 0
    eng.submit_reduce(0, owners, returns=[[1, 0]], held=held).wait(10.0)
    for k in range(len(GRAD_KINDS)):
        want0 = before[0][k][0] + before[1][k][1]
        assert torch.equal(grads[0][k][0].view(torch.uint8), want0.view(torch.uint8))
        assert not grads[1][k][1].any() and torch.equal(grads[2][k][2], before[2][k][2])


def test_gradient_dtypes_and_kinds_are_checked():
    topo = foremoe.Topology(1, 2, 2)
    eng = fe.TransferEngine(topology=topo, num_layers=1, num_experts=3, tensors=[64, 32])
    with pytest.raises(ValueError, match="1 tensors given, the engine has 2"):
        eng.register_grads(0, 0, [torch.zeros(2, 4)])
    with pytest.raises(ValueError, match="tensor 1 .*one dtype, got float16 after bfloat16"):
        eng.register_grads(0, 0, [torch.zeros(2, 4, dtype=torch.bfloat16), torch.zeros(2, 4, dtype=torch.float16)])
    with pytest.raises(ValueError, match=r"tensor 0 .*expected \[2, \.\.\.\]"):
        eng.register_grads(0, 0, [torch.zeros(3, 4), torch.zeros(2, 4)])
    with pytest.raises(ValueError, match="grad_bytes applies to one packed tensor"):
        eng.register_grads(0, 0, [torch.zeros(2, 4), torch.zeros(2, 4)], grad_bytes=8)
    with pytest.raises(ValueError, match="int8"):
        eng.register_grads(0, 0, [torch.zeros(2, 4, dtype=torch.int8), torch.zeros(2, 4, dtype=torch.int8)])
    eng.register_grads(0, 0, [torch.zeros(2, 4, dtype=torch.float64), torch.zeros(2, 3, dtype=torch.float64)])
    with pytest.raises(ValueError, match="gradient type float32 differs from float64 registered before"):
        eng.register_grads(0, 1, [torch.zeros(2, 4), torch.zeros(2, 3)])
    with pytest.raises(ValueError, match="gradient tensor sizes"):
        eng.register_grads(0, 1, [torch.zeros(2, 4, dtype=torch.float64), torch.zeros(2, 2, dtype=torch.float64)])


def test_held_replica_gradients_return_once_and_guard_their_slot():
    topo = foremoe.Topology(1, 2, 2)
    eng = fe.TransferEngine(topology=topo, num_layers=1, num_experts=3, expert_bytes=64)
    slots = [torch.zeros(2, 16) for _ in range(2)]
    grads = [torch.zeros(2, 16) for _ in range(2)]
    for g in range(2):
        eng.register_slots(0, g, slots[g])
        eng.register_grads(0, g, grads[g])
    eng.set_resident(0, [[0, 1], [2, 0]])  # expert 0 owned by GPU 0 (slot 0), replicated on GPU 1 (slot 1)
    owners = [0, 0, 1]
    grads[1][1] += 3.0  # the replica's first micro-step
    eng.submit_reduce(0, owners, held=[[-1, -1, -1], [0, -1, -1]]).wait(10.0)  # kept: stays in place
    assert torch.equal(grads[0][0], torch.zeros(16)) and torch.equal(grads[1][1], torch.full((16,), 3.0))
    with pytest.raises(ValueError, match="layer 0 GPU 1 slot 1 holds the gradient of expert 0 for owner GPU 0"):
        eng.set_resident(0, [[0, 1], [2, 1]])
    with pytest.raises(ValueError, match="held by an earlier reduction"):
        eng.submit_reduce(0, owners, returns=[])
    grads[1][1] += 4.0  # the second micro-step accumulates in place
    eng.submit_reduce(0, owners, returns=[[1, 0]]).wait(10.0)  # the next plan drops it: returned once
    assert torch.equal(grads[0][0], torch.full((16,), 7.0))
    assert torch.equal(grads[1][1], torch.zeros(16))  # zeroed after its return
    eng.set_resident(0, [[0, 1], [2, 1]])  # the slot may be reused now
    eng.set_resident(0, [[0, 1], [2, 0]])
    for bad, match in [([[1, 0], [1, 0]], "GPU 1 expert 0 twice"), ([[0, 0]], "its owner, not a replica"),
                       ([[5, 0]], "returns names GPU 5"), ([[1, 7]], "returns names expert 7"),
                       ([[0, 2]], "layer 0 GPU 0 holds no valid copy"), ([1, 0, 1], "pairs")]:
        with pytest.raises(ValueError, match=match):
            eng.submit_reduce(0, owners, returns=bad)
    with pytest.raises(ValueError, match="held has 2 entries, expected GPUs x experts = 6"):
        eng.submit_reduce(0, owners, held=[-1, -1])


def test_runtime_count_loads_and_map_tokens_on_cpu_tensors():
    rng = np.random.default_rng(11)
    T, L, K, E = 300, 3, 2, 8
    ids = np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(L)]) for _ in range(T)])
    ids[rng.random((T, L)) < 0.05, 0] = -1
    offsets = [0, 120, 300]
    for dtype in (torch.int16, torch.int32, torch.int64):
        t = torch.from_dlpack(np.ascontiguousarray(ids, dtype=np.int64)).to(dtype)
        got = fe.count_loads(t, offsets, num_experts=E, threads=2)
        want = foremoe.count_loads(np.ascontiguousarray(ids, dtype=np.int64), offsets, num_experts=E)
        assert got.dtype == torch.int64 and np.array_equal(np.from_dlpack(got), want)
    with pytest.raises(ValueError, match="expert 8|id 8|8"):
        fe.count_loads(torch.full((4, 1, 1), 8, dtype=torch.int32), num_experts=E)

    topo = foremoe.Topology(1, 2, 6)
    loads = foremoe.count_loads(np.ascontiguousarray(ids, dtype=np.int64), num_experts=E)[0]
    plan = foremoe.Planner(topo).plan(loads)
    t = torch.from_dlpack(np.ascontiguousarray(ids, dtype=np.int32))
    want = plan.map_tokens(np.ascontiguousarray(ids, dtype=np.int32))
    for layer in range(L):
        got = fe.map_tokens(plan, layer, t)
        assert got.shape == (T, K) and np.array_equal(np.from_dlpack(got), want[:, layer])
    with pytest.raises(ValueError, match="layer 5 outside"):
        fe.map_tokens(plan, 5, t)


def test_workspace_enqueues_and_reports_at_check():
    ws = fe.Workspace("cpu")
    ids = torch.tensor([[[0, 1]], [[2, 1]], [[3, 0]]], dtype=torch.int32)
    loads = fe.count_loads(ids, [0, 1, 3], num_experts=4, workspace=ws)
    assert ws.check(timeout=1.0) is True
    assert loads.tolist() == [[[1, 1, 0, 0]], [[1, 1, 1, 1]]]
    fe.count_loads(torch.full((2, 1, 1), 7, dtype=torch.int32), num_experts=4, workspace=ws)
    with pytest.raises(ValueError, match="7"):
        ws.check(timeout=1.0)
    assert ws.check() is True  # the records were reused
    with pytest.raises(TypeError, match="Workspace"):
        fe.count_loads(ids, num_experts=4, workspace=object())


needs_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and fe.runtime_build_info()["cuda_compiled"]),
    reason="needs a GPU and the extension built with FOREMOE_PYTHON_CUDA=ON")


@needs_cuda
def test_cuda_backend_moves_streams_events_and_counting():
    rng = np.random.default_rng(21)
    topo = foremoe.Topology(1, 4, 3)
    L, E = 2, 8
    plans = foremoe.Planner(topo).plan(skewed_loads(rng, 3, L, E))
    c = Cluster(topo, L, E, torch.bfloat16, 4096, seed=21, device="cuda", backend="cuda",
                cuda_device_of_gpu=[0] * topo.num_gpus, verify=True)
    for layer in range(L):
        c.place(layer, initial_placement(plans[0], layer))
    torch.cuda.synchronize()
    stream = torch.cuda.current_stream()
    for plan in plans:
        for layer in range(L):
            free = torch.cuda.Event()
            free.record(stream)
            t = c.engine.submit(plan, layer, slots_free=free)
            t.enqueue_wait(stream)  # the stream waits on the device
            t.wait(timeout=30.0)
            moves = np.asarray(plan.moves)
            for _, e, _, g, s in moves[moves[:, 0] == layer]:
                c.put(layer, int(g), int(s), int(e), ref_only=True)
            assert np.array_equal(c.bytes(layer), c.ref[layer])
    with pytest.raises(ValueError, match="must be on CUDA device 0"):
        c.engine.register_slots(0, 0, torch.zeros(3, 4096, dtype=torch.bfloat16))

    T, K = 500, 2
    ids = torch.from_dlpack(rng.integers(0, E, (T, L, K)).astype(np.int32))
    ws = fe.Workspace("cuda")
    got = fe.count_loads(ids.cuda(), [0, 200, 500], num_experts=E, workspace=ws)
    assert ws.check(timeout=10.0)
    assert torch.equal(got.cpu(), fe.count_loads(ids, [0, 200, 500], num_experts=E))
    loads = fe.count_loads(ids, num_experts=E)[0]
    plan = foremoe.Planner(topo).plan(np.from_dlpack(loads))
    for layer in range(L):
        assert torch.equal(fe.map_tokens(plan, layer, ids.cuda(), workspace=ws).cpu(), fe.map_tokens(plan, layer, ids))
    assert ws.check(timeout=10.0)


def test_registered_memory_lives_as_long_as_the_engine():
    import gc
    import weakref

    eng = fe.TransferEngine(topology=foremoe.Topology(1, 1, 2), num_layers=1, num_experts=2, expert_bytes=64)
    slots = np.zeros((2, 64), dtype=np.uint8)  # NumPy arrays work too on the host backend (and take weak refs)
    alive = weakref.ref(slots)
    eng.register_slots(0, 0, slots)
    del slots
    gc.collect()
    assert alive() is not None, "the engine let go of memory it may still write"
    del eng
    gc.collect()
    assert alive() is None, "the engine kept the memory after it was destroyed"


@pytest.mark.parametrize("paired_only", [False, True])
def test_paired_only_faults_spare_a_process_own_copies(paired_only):
    """Every copy fails with probability 1; with paired_only a single process has no paired transfer to fail, so
    its own copies (GPU to GPU, and from the mirror) land; without it every path fails and the batch says so."""
    faults = fe.FaultSchedule(fail_probability=1.0, seed=3, paired_only=paired_only)
    assert faults.paired_only is paired_only
    c = small(faults=faults, verify=True)
    t = c.engine.submit([[0, 0, 1, 1], [3, 1, 0, 0]], 0)
    if paired_only:
        t.wait(timeout=10.0)
        assert c.holds(0, 1, 1, 0) and c.holds(0, 0, 0, 3)
        assert all(m["ok"] and m["attempts"] == m["num_chunks"] for m in t.telemetry())
    else:
        with pytest.raises(fe.TransferError, match="failed on every path"):
            t.wait(timeout=10.0)
        assert c.engine.valid_expert(0, 1, 1) == -1 and c.engine.valid_expert(0, 0, 0) == -1


@pytest.mark.parametrize("spare", [False, True])
def test_spare_reductions_keeps_the_injector_off_reductions(spare):
    """Every copy fails with probability 1: with spare_reductions the reduction's copies get no fault and the owner
    row is its own gradient plus the replica's, while a move batch on the same engine still fails; without it the
    reduction fails and the owner row keeps its own gradient."""
    faults = fe.FaultSchedule(fail_probability=1.0, seed=3, spare_reductions=spare)
    assert faults.spare_reductions is spare and "spare_reductions" in fe.FaultSchedule.fields()
    topo = foremoe.Topology(1, 2, 2)
    eng = fe.TransferEngine(topology=topo, num_layers=2, num_experts=3, expert_bytes=64, faults=faults,
                            host_mirror=False)
    slots = [torch.zeros(2, 16) for _ in range(2)]
    grads = [torch.randn(2, 16, generator=torch.Generator().manual_seed(g)) for g in range(2)]
    for g in range(2):
        eng.register_slots(0, g, slots[g])
        eng.register_grads(1, g, grads[g])
    eng.set_resident(1, [[0, 1], [2, 0]])  # expert 0 owned by GPU 0 (slot 0), replicated on GPU 1 (slot 1)
    own, want = grads[0][0].clone(), grads[0][0] + grads[1][1]
    t = eng.submit_reduce(1, [0, 0, 1])
    if spare:
        t.wait(10.0)
        assert torch.equal(grads[0][0], want)
    else:
        with pytest.raises(fe.TransferError):
            t.wait(10.0)
        assert torch.equal(grads[0][0], own)
    eng.set_resident(0, [[0, 1], [2, -1]])
    with pytest.raises(fe.TransferError):  # the moves still meet the faults
        eng.submit([[0, 0, 1, 1]], 0).wait(10.0)
    eng.close()


# -- split (per-kind) regions: one tensor per weight kind, as ExpertStorage keeps them -------------------------------

KINDS = [(torch.float32, (370,)), (torch.bfloat16, (2, 500)), (torch.uint8, (9,))]  # row bytes 1480, 2000, 9


def kind_bytes(dtype, shape):
    return int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()


def put_row(t, index, data):
    """Writes NumPy bytes `data` into row `index` of tensor `t` (any dtype and row shape)."""
    t[index].view(torch.uint8).view(-1)[:] = torch.from_numpy(np.ascontiguousarray(data, dtype=np.uint8))


@pytest.mark.parametrize("num_buffers", [1, 2])
def test_per_kind_tensor_lists_land_the_bytes_a_reference_says(num_buffers):
    topo, E = foremoe.Topology(2, 2, 2), 6
    G, S = topo.num_gpus, topo.slots
    rng = np.random.default_rng(num_buffers)
    sizes = [kind_bytes(d, s) for d, s in KINDS]
    ref = [rng.integers(0, 256, (E, n), dtype=np.uint8) for n in sizes]  # per kind: each expert's bytes
    buf = (2,) if num_buffers == 2 else ()
    slots = [[torch.full(buf + (S,) + shape, 0, dtype=dtype) for dtype, shape in KINDS] for _ in range(G)]
    for g in range(G):
        for t in slots[g]:
            t.view(torch.uint8).fill_(FILL)
    mirrors = [[torch.empty((E,) + shape, dtype=dtype) for dtype, shape in KINDS] for _ in range(topo.nodes)]
    for n in range(topo.nodes):
        for k, t in enumerate(mirrors[n]):
            for e in range(E):
                put_row(t, e, ref[k][e])
    # Bare sizes: the kinds back to back (their offsets are not used by split regions).
    eng = fe.TransferEngine(topology=topo, num_experts=E, tensors=sizes, verify=True, max_chunk_bytes=256,
                            align_bytes=64, faults=fe.FaultSchedule(fail_paths=["nvlink"], seed=3))
    assert eng.options.tensors == [(0, 1480), (1480, 2000), (3480, 9)]
    for g in range(G):
        eng.register_slots(0, g, slots[g], num_buffers=num_buffers)
    for n in range(topo.nodes):
        eng.register_mirror(0, n, tuple(mirrors[n]))

    def holds(g, s, e, b=0):
        return all(np.array_equal(byte_view(t[(b, s) if num_buffers == 2 else s].contiguous()).reshape(-1),
                                  ref[k][e]) for k, t in enumerate(slots[g]))

    resident = np.array([[0, 1], [2, -1], [3, 4], [-1, 5]], dtype=np.int32)
    for g in range(G):
        for s in range(S):
            if resident[g, s] >= 0:
                for k, t in enumerate(slots[g]):
                    put_row(t, (0, s) if num_buffers == 2 else s, ref[k][resident[g, s]])
    eng.set_resident(0, resident)
    moves = np.array([[5, 3, 0, 1], [0, 0, 1, 1], [1, 0, 3, 0], [4, 2, 1, 0]], dtype=np.int32)
    dst_buffer = num_buffers - 1
    t = eng.submit(moves, 0, dst_buffer=dst_buffer)
    t.wait(timeout=30.0)
    tel = t.telemetry()
    for (e, _, g, s), m in zip(moves.tolist(), tel):
        assert m["ok"] and m["verified"] and m["verify_failures"] == 0, m
        assert holds(g, s, e, dst_buffer), f"GPU {g} slot {s}: wrong bytes for expert {e}"
        assert eng.valid_expert(0, g, s) == e
        # NVLink is down and nothing else fails: a move retried had a chunk over NVLink first, which then landed
        # from the mirror, and says so.
        assert m["fallback"] == (m["attempts"] > m["num_chunks"]), m
    assert eng.last_plan(0)["path_bytes"]["nvlink"] > 0
    assert any(m["fallback"] for m in tel), "no move went over NVLink first: the fault proved nothing"
    for g in range(G):  # untouched slots keep their bytes (and the other buffer its old copy)
        for s in range(S):
            if resident[g, s] >= 0 and not any(mv[2] == g and mv[3] == s for mv in moves.tolist()):
                assert holds(g, s, int(resident[g, s]))


def test_per_kind_mirror_views_inside_a_node_segment():
    import os

    from foremoe import _core

    topo, E = foremoe.Topology(1, 2, 2), 3
    sizes = [kind_bytes(d, s) for d, s in KINDS]
    offsets, off = [], 0
    for n in sizes:  # one 64-byte aligned block per kind, as foremoe.torch's node mirror lays them out
        offsets.append(off)
        off = (off + E * n + 63) // 64 * 64
    seg = _core.NodeMirror.create(f"split-{os.getpid()}", 0, 0, offsets[-1] + E * sizes[-1])
    seg.unlink()
    base = torch.from_numpy(seg.array())
    views = [base[o:o + E * n].view(dtype).view((E,) + shape) for o, n, (dtype, shape) in zip(offsets, sizes, KINDS)]
    seg.begin_refresh()
    for k, v in enumerate(views):
        for e in range(E):
            v[e].view(torch.uint8).fill_(e * 10 + k + 1)
    seg.end_refresh()
    eng = fe.TransferEngine(topology=topo, num_experts=E, tensors=sizes)
    slots = [[torch.zeros((2,) + shape, dtype=dtype) for dtype, shape in KINDS] for _ in range(2)]
    for g in range(2):
        eng.register_slots(0, g, slots[g])
    other = [torch.zeros((E,) + shape, dtype=dtype) for dtype, shape in KINDS]
    with pytest.raises(ValueError, match="tensor 0: .*do not fit node mirror"):
        eng.register_mirror(0, 0, other, node_mirror=seg)
    with pytest.raises(ValueError, match="3 tensors given, the engine has 3|2 tensors given, the engine has 3"):
        eng.register_mirror(0, 0, views[:2], node_mirror=seg)
    with pytest.raises(ValueError, match="node_mirror must be"):
        eng.register_mirror(0, 0, views, node_mirror=base)
    eng.register_mirror(0, 0, views, node_mirror=seg)
    resident = np.array([[-1, -1], [1, -1]], dtype=np.int32)
    for k in range(len(KINDS)):
        slots[1][k][0].view(torch.uint8).fill_(1 * 10 + k + 1)

    def move(expert):
        for t in slots[0]:
            t.zero_()
        eng.set_resident(0, resident)
        eng.submit(np.array([[expert, -1, 0, 0]]), 0).wait()

    def landed(expert):
        return all(bool((t[0].view(torch.uint8) == expert * 10 + k + 1).all()) for k, t in enumerate(slots[0]))

    move(2)
    assert landed(2)
    seg.begin_refresh()  # stale: only GPU sources
    with pytest.raises(ValueError, match="no source|mirror"):
        move(2)
    move(1)
    assert landed(1)
    seg.end_refresh()
    move(2)
    assert landed(2)
