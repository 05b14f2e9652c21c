"""The Python API given bad input (issue 27, item 4): each test is named after the defect it covers and failed
before its fix. foremoe.torch's cases are in test_torch_bad_input.py.

2. Integers silently truncated (8.7 -> 8) or wrapped (2**32 + e -> e), negative history loads accepted.
3. Messages that did not name the argument, the key, the position or the value.
"""

import base64
import json

import numpy as np
import pytest

import foremoe
from foremoe import _core

TOPO = foremoe.Topology(1, 2, 3)  # 2 GPUs x 3 slots
LOADS = np.array([[5, 3, 1, 1]], dtype=np.int64)  # 1 layer, 4 experts


@pytest.fixture(scope="module")
def plan():
    return foremoe.Planner(TOPO).plan(LOADS)


def nested(depth, leaf=None):
    d = leaf
    for i in range(depth):
        d = {"a": d} if i % 2 else [d]
    return d


# -- 2. silent wraps and truncation ---------------------------------------------------------------------------------


def test_resident_id_past_int32_accepted_as_another_expert():
    resident = np.array([[[0, 1, 2**32 + 2], [2, 3, -1]]])
    with pytest.raises(ValueError, match=r"^plan: resident\[0, 0, 2\] = 4294967298 is outside \[-1, 3\]$"):
        foremoe.Planner(TOPO).plan(LOADS, resident=resident)
    with pytest.raises(ValueError, match=r"^Placement.from_array: gpu_slots\[0, 0, 2\] = 4294967298 is outside"):
        foremoe.Placement.from_array(TOPO, resident, 4)


def test_owner_past_int32_taken_as_gpu_0():
    with pytest.raises(ValueError, match=r"^plan: owners\[0\] = 4294967296 is outside int32"):
        foremoe.Planner(TOPO).plan(LOADS, owners=np.array([2**32, 0, 1, 1]))


def test_negative_previous_loads_accepted():
    with pytest.raises(ValueError, match=r"^plan: previous_loads\[0, 1\] = -3 is negative$"):
        foremoe.Planner(TOPO, strategy="eplb").plan(LOADS, previous_loads=np.array([[5, -3, 1, 1]]))
    with pytest.raises(ValueError, match=r"^plan: previous_loads\[1, 0, 2\] = -1 is negative$"):
        foremoe.Planner(TOPO).plan(LOADS, previous_loads=np.array([[[1, 1, 1, 1]], [[1, 1, -1, 1]]]))


@pytest.mark.parametrize("call, match", [
    (lambda: foremoe.count_loads(np.zeros((2, 1, 1), np.int32), num_experts=8.7),
     r"^count_loads: num_experts must be an integer, got 8.7$"),
    (lambda: foremoe.count_loads(np.zeros((2, 1, 1), np.int32), num_experts=4, num_sources=1.5),
     r"^count_loads: num_sources must be an integer, got 1.5$"),
    (lambda: foremoe.count_loads(np.zeros((2, 1, 1), np.int32), num_experts=4, layer_map=[0.5]),
     r"^count_loads: layer_map\[0\] = 0.5 is not an integer$"),
    (lambda: foremoe.export_placement(np.array([[0, 1, 2, 3]]), "-", num_experts=8.7),
     r"^export_placement: num_experts must be an integer, got 8.7$"),
    (lambda: foremoe.rebalance_experts(np.ones((1, 16)), 16.5, 1, 1, 2),
     r"^rebalance_experts: num_replicas must be an integer, got 16.5$"),
    (lambda: foremoe.rebalance_experts(np.ones((1, 16)), 16, 1.5, 1, 2),
     r"^rebalance_experts: num_groups must be an integer, got 1.5$"),
    (lambda: foremoe.rebalance_experts(np.ones((1, 16)), 16, 1, 1, 2.5),
     r"^rebalance_experts: num_gpus must be an integer, got 2.5$"),
    (lambda: foremoe.rebalance_experts(np.ones((1, 16)), 16, 1, 2**32 + 1, 2),
     r"^rebalance_experts: num_nodes = 4294967297 is outside int32"),
    (lambda: foremoe.read_sglang([], 1.5, 2), r"^read_sglang: num_layers must be an integer, got 1.5$"),
    (lambda: foremoe.read_sglang([], 2, 2**32 + 2), r"^read_sglang: topk = 4294967298 is outside int32"),
    (lambda: foremoe.read_trace("missing.npy", num_layers=2.5), r"^read_trace: num_layers must be an integer"),
    (lambda: foremoe.Topology(1, 2.5, 3), r"^Topology: gpus_per_node must be an integer, got 2.5$"),
    (lambda: foremoe.Topology(1, 2, 2**32 + 3), r"^Topology: slots = 4294967299 is outside int32"),
    (lambda: TOPO.validate(4.5), r"^Topology.validate: num_experts must be an integer, got 4.5$"),
    (lambda: foremoe.Placement.from_array(TOPO, np.array([[[0, 1, 2], [3, 0, 1]]]), 4.5),
     r"^Placement.from_array: num_experts must be an integer, got 4.5$"),
    (lambda: foremoe.Placement.from_array(TOPO, np.array([[[0, 1.7, 2], [3, 0, 1]]]), 4),
     r"^Placement.from_array: gpu_slots\[0, 0, 1\] = 1.7 is not an integer$"),
])
def test_integer_arguments_silently_truncated_or_wrapped(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_plan_method_integers_truncated(plan):
    with pytest.raises(ValueError, match=r"^source_split: layer must be an integer, got 0.5$"):
        plan.source_split(0.5, np.ones((4, 2), np.int64))
    with pytest.raises(ValueError, match=r"^map_tokens: layer_map\[0\] = 0.5 is not an integer$"):
        plan.map_tokens(np.zeros((2, 1, 1), np.int32), layer_map=[0.5])
    with pytest.raises(ValueError, match=r"^dispatch: rank must be an integer, got 0.5$"):
        plan.dispatch(0, np.zeros((2, 1, 1), np.int32), np.zeros((6, 2), np.int64), 0.5)
    with pytest.raises(ValueError, match=r"^transfers: expert_bytes must be an integer, got 100.5$"):
        plan.transfers(None, expert_bytes=100.5)


def test_phy2log_float_truncated():
    with pytest.raises(ValueError, match=r"^export_placement: phy2log\[0, 1\] = 1.7 is not an integer$"):
        foremoe.export_placement(np.array([[0, 1.7, 2, 3]]), "-")
    with pytest.raises(ValueError, match=r"^export_placement: phy2log\[0, 2\] = 18446744073709551616 is outside"):
        foremoe.export_placement([[0, 1, 2**64, 3]], "-")


def test_whole_floats_and_numpy_integers_accepted(plan, capsys):
    """What the checks let through: NumPy integers, floats holding whole numbers, whole-number float arrays."""
    assert repr(foremoe.Topology(np.int64(1), 2.0, np.int32(3))) == "Topology(1, 2, 3)"
    assert foremoe.count_loads(np.zeros((2, 1, 1), np.int32), num_experts=np.int64(4)).shape == (1, 1, 4)
    p2l, _, _ = foremoe.rebalance_experts(np.ones((1, 16)), 16.0, np.int8(1), 1, 2)
    foremoe.export_placement(p2l.astype(np.float64), "-", num_experts=16.0)
    assert json.loads(capsys.readouterr().out)["physical_to_logical_map"] == p2l.tolist()
    got = foremoe.Planner(TOPO).plan(LOADS.astype(np.float32), resident=plan.gpu_slots.astype(np.float64),
                                     owners=plan.owner_gpu[0].astype(np.int64))
    assert got.gpu_slots.shape == (1, 2, 3)


def test_bool_taken_as_an_integer():
    with pytest.raises(TypeError, match=r"^Topology: nodes must be an integer, got bool True$"):
        foremoe.Topology(True, 2, 3)
    with pytest.raises(TypeError, match=r"^count_loads: num_experts must be an integer, got bool True$"):
        foremoe.count_loads(np.zeros((2, 1, 1), np.int32), num_experts=True)


# -- 3. messages ------------------------------------------------------------------------------------------------------


def test_incompatible_function_arguments_names_no_argument():
    for call, exc, match in [
        (lambda: foremoe.Topology(1, "2", 3), TypeError, r"^Topology: gpus_per_node must be an integer, got str '2'$"),
        (lambda: foremoe.Topology(1, 2, "x"), TypeError, r"^Topology: slots must be an integer, got str 'x'$"),
        (lambda: _core.EngineOptions(num_experts=8.7), ValueError,
         r"^EngineOptions: num_experts must be an integer, got 8.7$"),
        (lambda: _core.EngineOptions(num_experts=2**40), ValueError,
         r"^EngineOptions: num_experts = 1099511627776 does not fit the option's C\+\+ integer type$"),
        (lambda: _core.EngineOptions(topology="x"), TypeError,
         r"^EngineOptions: topology must be foremoe._core.Topology, got str 'x'$"),
        (lambda: _core.FaultSchedule(fail_probability="x"), TypeError,
         r"^FaultSchedule: fail_probability must be float, got str 'x'$"),
    ]:
        with pytest.raises(exc, match=match) as info:
            call()
        assert "incompatible function arguments" not in str(info.value)
    assert _core.EngineOptions(num_experts=8.0).num_experts == 8


def test_complex_dtype_reported_as_other64(plan):
    with pytest.raises(ValueError, match=r"int32 or int64, got complex64$"):
        foremoe.count_loads(np.zeros((2, 1, 1), np.complex64), num_experts=4)
    with pytest.raises(ValueError, match=r"int32 or int64, got complex128$"):
        plan.map_tokens(np.zeros((2, 1, 1), np.complex128))
    with pytest.raises(ValueError, match=r"^plan: loads must hold integers, got dtype complex128$"):
        foremoe.Planner(TOPO).plan(LOADS.astype(np.complex128))


def test_negative_weight_message_names_no_position_or_value():
    with pytest.raises(ValueError, match=r"^rebalance_experts: weight\[1, 2\] = -7 is not a finite non-negative "):
        foremoe.rebalance_experts(np.array([[1, 2, 3, 4], [1, 2, -7, 4]]), 4, 1, 1, 2)


@pytest.mark.parametrize("call, match", [
    (lambda: foremoe.simulate({"sim": {"seed": float("inf")}}),
     r"^config.sim.seed: inf is not a finite number \(JSON has no NaN or infinity\)$"),
    (lambda: foremoe.simulate({"model": {"layers": [1, float("nan")]}}), r"^config.model.layers\[1\]: nan is not"),
    (lambda: foremoe.Planner(TOPO, tolerance=float("nan")), r"^Planner.tolerance: nan is not a finite number"),
    (lambda: foremoe.synthetic_loads(prompt_mean=-float("inf")), r"^synthetic_loads.prompt_mean: -inf is not"),
    (lambda: foremoe.simulate({"preset": b"tiny"}), r"^config.preset: bytes b'tiny' is not a JSON value"),
])
def test_config_out_of_range_float_names_no_key(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_deeply_nested_config_raises_recursion_error():
    for depth in (300, 5000):
        with pytest.raises(ValueError, match=r"^config: nested deeper than 256 levels \(at config\.a\.a\[0\]\.a\[0\]"):
            foremoe.simulate({"a": nested(depth)})
    with pytest.raises(ValueError, match=r"^Planner: nested deeper than 256 levels"):
        foremoe.Planner(TOPO, strategy=nested(3000))
    with pytest.raises(ValueError, match="unknown key 'a'"):  # within the bound: the C++ reader's message
        foremoe.simulate({"a": nested(200)})


def test_sglang_bytes_refused_as_malformed_base64():
    ids = np.arange(6, dtype=np.int32)  # 3 tokens x 1 layer x 2
    b64 = base64.b64encode(ids.tobytes())
    want, _ = foremoe.read_sglang([b64.decode()], 1, 2)
    for given in ([{"routed_experts": b64}], [{"meta_info": {"routed_experts": b64}}], [b64], [bytearray(b64)],
                  [memoryview(b64)], [json.dumps({"routed_experts": b64.decode()}).encode() + b"\n"], b64):
        got, offsets = foremoe.read_sglang(given, 1, 2)
        np.testing.assert_array_equal(got, want)
        assert offsets.tolist() == [0, 3]
    for raw in ([ids.tobytes()], [{"routed_experts": ids.tobytes()}]):  # not base64: said to be bytes
        with pytest.raises(ValueError, match=r"^read_sglang: requests:1(: routed_experts)?: got 24 bytes that are "
                                             r"neither a JSON line nor base64") as info:
            foremoe.read_sglang(raw, 1, 2)
        assert "malformed base64" not in str(info.value)


def test_sglang_list_or_int_items_raise_unclear_errors():
    for given, match in [([[1, 2]], r"^read_sglang: requests:1 is list \[1, 2\]; a request is a JSON line"),
                         (["AAAAAAAAAAA=", 5], r"^read_sglang: requests:2 is int 5; a request is"),
                         ([None], r"^read_sglang: requests:1 is NoneType None"),
                         (5, r"^read_sglang: source must be a path or an iterable of requests, got int$")]:
        with pytest.raises(TypeError, match=match):
            foremoe.read_sglang(given, 1, 1)


def test_nan_in_phy2log_reported_as_empty_slot():
    with pytest.raises(ValueError, match=r"^export_placement: phy2log\[0, 1\] = nan is not an integer$"):
        foremoe.export_placement(np.array([[0, np.nan, 2, 3]]), "-")


def test_nan_source_loads_reported_as_negative_load(plan):
    with pytest.raises(ValueError, match=r"^source_split: source_loads\[0, 1\] = nan is not an integer$"):
        plan.source_split(0, np.array([[1.0, np.nan], [1, 1], [1, 1], [1, 1]]))
    with pytest.raises(ValueError, match=r"^dispatch: split\[0, 0\] = nan is not an integer$"):
        plan.dispatch(0, np.zeros((2, 1, 1), np.int32), np.full((6, 2), np.nan), 0)
