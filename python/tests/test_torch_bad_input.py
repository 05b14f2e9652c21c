"""foremoe.torch given bad input or left in a bad state (issue 27, item 4): each test is named after the defect
it covers and failed before its fix.

1. A ReplayDriver still planning when the interpreter exits aborted the process (exit 134).
2. Integers silently truncated or wrapped.
3. Unclear messages: AttributeError for a list where a tensor goes, a NaN load reported as a negative one, a
   tensor that requires grad refused with RuntimeError.
"""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="skipped: PyTorch (torch) is not installed; foremoe.torch needs it")

import foremoe  # noqa: E402
import foremoe.torch as ft  # noqa: E402
from foremoe.torch import engine  # noqa: E402

# -- 1. the planning thread at interpreter exit ----------------------------------------------------------------------

# A stage long enough to plan (~0.2 s) that the thread is inside the C++ planner when the script ends.
EXIT_SCRIPT = textwrap.dedent("""
    import sys, time
    import numpy as np
    import foremoe, foremoe.torch as ft

    how, owners = sys.argv[1], sys.argv[2] == "owners"
    loads = np.random.default_rng(0).integers(0, 1000, size=(64, 48, 256)).astype(np.int64)
    planner = foremoe.Planner(foremoe.Topology(4, 8, 12))
    driver = ft.ReplayDriver(planner, loads, owners=np.repeat(np.arange(32), 8) if owners else None)
    time.sleep(0.02)  # the thread is planning now
    assert driver.running
    if how == "raise":
        raise RuntimeError("the trainer failed")
    if how == "exit3":
        sys.exit(3)
    if how == "del":
        del driver  # the thread holds the driver: it is collected at exit
    print("done")
""")


@pytest.mark.parametrize("how, code, owners", [("end", 0, "stage-owners"), ("raise", 1, "stage-owners"),
                                               ("raise", 1, "owners"), ("exit3", 3, "owners"),
                                               ("del", 0, "stage-owners")])
def test_replay_driver_planning_at_exit_aborts_with_134(tmp_path, how, code, owners):
    script = tmp_path / "trainer.py"
    script.write_text(EXIT_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    r = subprocess.run([sys.executable, str(script), how, owners], capture_output=True, text=True, timeout=120,
                       env=env)
    assert r.returncode == code, r.stderr[-2000:]
    assert "terminate called" not in r.stderr
    if how == "raise":
        assert "RuntimeError: the trainer failed" in r.stderr


def test_replay_driver_del_while_planning_does_not_raise():
    loads = np.random.default_rng(1).integers(0, 1000, size=(16, 8, 64)).astype(np.int64)
    d = ft.ReplayDriver(foremoe.Planner(foremoe.Topology(2, 4, 10)), loads)
    d.__del__()  # as the collector would: stops and joins, never raises
    assert not d.running
    d.__del__()  # twice is fine


# -- 2. silent wraps and truncation ---------------------------------------------------------------------------------

E, H = 4, 3


def full_weights():
    return {"w": torch.arange(E * H, dtype=torch.float32).reshape(E, H)}


def test_expert_storage_slots_float_truncated():
    with pytest.raises(ValueError, match=r"^ExpertStorage: slots must be an integer, got 9.5$"):
        ft.ExpertStorage.from_full(full_weights(), [0] * E, 9.5, rank=0, world=1)
    with pytest.raises(ValueError, match=r"^ExpertStorage: rank must be an integer, got 0.5$"):
        ft.ExpertStorage.from_full(full_weights(), [0] * E, 5, rank=0.5, world=1)
    with pytest.raises(ValueError, match=r"^ExpertStorage: world must be an integer, got 1.5$"):
        ft.ExpertStorage.from_full(full_weights(), [0] * E, 5, rank=0, world=1.5)
    with pytest.raises(ValueError, match=r"^BalancedMoE: slots must be an integer, got 9.5$"):
        ft.BalancedMoE(ft.SwiGLUExperts(E, 8, 16), 9.5)


def test_balanced_moe_layer_float_truncated():
    with pytest.raises(ValueError, match=r"^BalancedMoE: layer must be an integer, got 0.5$"):
        ft.BalancedMoE(ft.SwiGLUExperts(E, 8, 16), E, layer=0.5)
    with pytest.raises(ValueError, match=r"^BalancedMoE: layer = -1 is outside \[0, "):
        ft.BalancedMoE(ft.SwiGLUExperts(E, 8, 16), E, layer=-1)
    plan = foremoe.Planner(foremoe.Topology(1, 1, E)).plan(np.array([[4, 3, 2, 1]]))
    with pytest.raises(ValueError, match=r"^local_layout: layer must be an integer, got 0.5$"):
        ft.local_layout(plan, 0.5, torch.zeros((2, 1), dtype=torch.int64), np.ones((E, 1), np.int64), 0)
    st = ft.ExpertStorage.from_full(full_weights(), [0] * E, E, rank=0, world=1)
    with pytest.raises(ValueError, match=r"^ExpertStorage: plan layer = -1 is outside \[0, 0\]$"):
        st.check_plan(plan, -1)  # was plan layer -1 = the last layer


def test_owner_past_int32_taken_as_rank_0():
    for call in (lambda: ft.ExpertStorage.from_full(full_weights(), [2**32, 0, 0, 0], 5, rank=0, world=1),
                 lambda: ft.BalancedMoE(ft.SwiGLUExperts(E, 8, 16), 5, owners=[2**32, 0, 0, 0])):
        with pytest.raises(ValueError, match=r"^(ExpertStorage|BalancedMoE): owners\[0\] = 4294967296 is outside "):
            call()
    planner = foremoe.Planner(foremoe.Topology(1, 2, 3))
    with pytest.raises(ValueError, match=r"^ReplayDriver: owners\[0\] = 4294967296 is outside int32"):
        ft.ReplayDriver(planner, np.ones((1, 1, E), np.int64), owners=np.array([2**32, 0, 1, 1]))


def test_replay_driver_integers_truncated():
    planner = foremoe.Planner(foremoe.Topology(1, 2, 3))
    loads = np.ones((2, 1, E), np.int64)
    with pytest.raises(ValueError, match=r"^ReplayDriver: num_layers must be an integer, got 1.5$"):
        ft.ReplayDriver(planner, loads, num_layers=1.5)
    with ft.ReplayDriver(planner, loads) as d:
        with pytest.raises(ValueError, match=r"^ReplayDriver.plan: layer must be an integer, got 0.5$"):
            d.plan(0, layer=0.5)
        d.plan(1)
        with pytest.raises(ValueError, match=r"^ReplayDriver.ready: micro_step = -1 is outside \[0, 1\]$"):
            d.ready(-1)  # was the last micro-step
    ids = np.zeros((4, 1, 1), np.int32)
    with pytest.raises(ValueError, match=r"^loads_from_ids: num_experts must be an integer, got 8.7$"):
        ft.loads_from_ids(ids, num_experts=8.7)
    with pytest.raises(ValueError, match=r"^loads_from_verl: micro_batches must be an integer, got 1.5$"):
        ft.loads_from_verl(ids.reshape(2, 2, 1, 1), np.ones((2, 2)), 1.5, num_experts=E)


def test_engine_integers_truncated():
    with pytest.raises(ValueError, match=r"^count_loads: num_experts must be an integer, got 8.7$"):
        engine.count_loads(torch.zeros((2, 1, 1), dtype=torch.int32), num_experts=8.7)
    with pytest.raises(ValueError, match=r"^count_loads: layer_map\[0\] = 0.5 is not an integer$"):
        engine.count_loads(torch.zeros((2, 1, 1), dtype=torch.int32), num_experts=4, layer_map=[0.5])
    eng = engine.TransferEngine(topology=foremoe.Topology(1, 2, 2), num_layers=1, num_experts=4, expert_bytes=256)
    with pytest.raises(ValueError, match=r"^valid_expert: slot must be an integer, got 0.5$"):
        eng.valid_expert(0, 0, 0.5)
    with pytest.raises(ValueError, match=r"^register_slots: layer must be an integer, got 0.5$"):
        eng.register_slots(0.5, 0, torch.zeros(2, 64))
    with pytest.raises(ValueError, match=r"^submit: layer \d+ moves\[0, 0\] = 1.5 is not an integer$"):
        eng.submit([[1.5, -1, 0, 0]], 0)
    with pytest.raises(ValueError, match=r"^EngineOptions: expert_bytes must be an integer, got 2.5$"):
        engine.TransferEngine(topology=foremoe.Topology(1, 2, 2), num_layers=1, num_experts=4, expert_bytes=2.5)


# -- 3. messages ------------------------------------------------------------------------------------------------------


def test_list_or_int_where_a_tensor_goes_raises_attribute_error():
    plan = foremoe.Planner(foremoe.Topology(1, 2, 3)).plan(np.array([[5, 3, 1, 1]]))
    for call, match in [
        (lambda: engine.count_loads([[[1]]], num_experts=4),
         r"^count_loads: routed_experts must be a torch.Tensor, got list \[\[\[1\]\]\] \(for NumPy arrays"),
        (lambda: engine.count_loads(5, num_experts=4), r"^count_loads: routed_experts must be a torch.Tensor, got int"),
        (lambda: engine.map_tokens(plan, 0, [[[1]]]), r"^map_tokens: routed_experts must be a torch.Tensor, got list"),
    ]:
        with pytest.raises(TypeError, match=match):
            call()


def test_nan_source_loads_reported_as_negative_load():
    plan = foremoe.Planner(foremoe.Topology(1, 2, 3)).plan(np.array([[5, 3, 1, 1]]))
    loads = np.array([[5.0, 0], [3, np.nan], [1, 0], [1, 0]])
    with pytest.raises(ValueError, match=r"^local_layout: source_loads\[1, 1\] = nan is not an integer$"):
        ft.local_layout(plan, 0, torch.zeros((2, 1), dtype=torch.int64), loads, 0)
    with pytest.raises(ValueError, match=r"^local_layout: source_loads\[1, 1\] = -2 is negative$"):
        ft.local_layout(plan, 0, torch.zeros((2, 1), dtype=torch.int64), np.nan_to_num(loads, nan=-2), 0)


def test_tensor_that_requires_grad_raises_runtime_error():
    planner = foremoe.Planner(foremoe.Topology(1, 2, 3))
    loads = torch.tensor([[5.0, 3, 1, 1]], requires_grad=True)  # e.g. a router's soft counts
    got = planner.plan(loads, previous_loads=loads * 2)  # read detached, as their values
    want = planner.plan(loads.detach().numpy(), previous_loads=loads.detach().numpy() * 2)
    np.testing.assert_array_equal(got.gpu_slots, want.gpu_slots)
    with pytest.raises(ValueError, match=r"^simulate: loads are 1 layers x 4 experts"):  # read, then refused
        foremoe.simulate(loads=loads[None])
    p2l, _, _ = foremoe.rebalance_experts(loads, 4, 1, 1, 2)
    assert p2l.shape == (1, 4)
    # The driver takes integer counts only: a float tensor is refused naming its dtype, grad or not.
    with pytest.raises(ValueError, match=r"^ReplayDriver: loads must hold integer counts, got dtype float32$"):
        ft.ReplayDriver(planner, loads[None])
    soft_mask = torch.ones(2, requires_grad=True)  # read, then refused for its dtype
    with pytest.raises(ValueError, match=r"^count_loads: mask must be bool or integer, got dtype float32$"):
        foremoe.count_loads(torch.zeros((2, 1, 1), dtype=torch.int32), num_experts=4, mask=soft_mask)
    with pytest.raises(ValueError, match=r"^attention_mask: attention mask must be bool or integer"):
        foremoe.read_verl(torch.zeros((1, 2, 1, 1), dtype=torch.int32), soft_mask[None])
    plan = planner.plan(np.array([[5, 3, 1, 1]]))
    src = torch.tensor([[5.0, 0], [3, 0], [1, 0], [1, 0]], requires_grad=True)
    ids = torch.tensor([0] * 5 + [1] * 3 + [2, 3]).reshape(-1, 1)
    layout = ft.local_layout(plan, 0, ids, src, 0)
    assert layout.num_send == 10
