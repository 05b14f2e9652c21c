"""Issue 27, sizes and sums: products of in-range sizes and sums of in-range loads are refused before anything is
allocated or overflows, with a message naming the values and the limit."""

import numpy as np
import pytest

import foremoe


def test_planner_refuses_loads_whose_layer_sum_overflows():
    # 8 loads of 2^61 sum to 2^64: the planner once returned max_gpu_load [0 0] and imbalance 1.0.
    planner = foremoe.Planner(foremoe.Topology(1, 2, 8))
    with pytest.raises(ValueError, match=r"the loads of layer 0 sum past 2\^42"):
        planner.plan(np.full((2, 8), 2**61, dtype=np.int64))


def test_planner_refuses_micro_steps_whose_step_sum_overflows():
    # Each micro-step is in range; their sum over the step (what owners are planned from) is not.
    planner = foremoe.Planner(foremoe.Topology(1, 2, 8))
    loads = np.full((4, 1, 8), 2**40, dtype=np.int64)
    with pytest.raises(ValueError, match=r"2\^42"):
        planner.plan(loads)


def test_planner_in_range_sums_still_plan():
    planner = foremoe.Planner(foremoe.Topology(1, 2, 8))
    loads = np.full((1, 8), 2**38, dtype=np.int64)  # a layer total of 2^41
    plan = planner.plan(loads)
    assert int(np.asarray(plan.max_gpu_load)[0]) == 2**40


def test_topology_refuses_work_beyond_the_bound():
    with pytest.raises(ValueError, match=r"17179869184 slots x 1048576 GPUs = .* is beyond the supported 2\^28"):
        foremoe.Topology(1024, 1024, 16384)
    foremoe.Topology(16, 64, 256)  # 1,024 GPUs x 256 slots: the largest real deployments fit


def test_count_loads_refuses_huge_expert_counts():
    ids = np.zeros((4, 2, 2), dtype=np.int32)
    with pytest.raises(ValueError, match=r"536870912 experts = .* load cells is beyond the supported 2\^28"):
        foremoe.count_loads(ids, [0, 4], num_experts=2**29)


def test_count_loads_refuses_huge_source_counts():
    ids = np.zeros((4, 2, 2), dtype=np.int32)
    with pytest.raises(ValueError, match=r"1000000001 \(sources \+ 1\) = .* is beyond the supported 2\^28"):
        foremoe.count_loads(ids, [0, 4], num_experts=8, num_sources=10**9)


def test_simulate_refuses_a_batch_that_would_take_hours():
    with pytest.raises(ValueError, match=r"6553[67] steps x .* routed ids to generate is beyond the supported 2\^34"):
        foremoe.simulate({"batch": {"steps": 65536}})


def test_vllm_export_refuses_more_experts_than_slots(tmp_path):
    phy2log = np.array([[0, 1, 2, 3]], dtype=np.int64)
    with pytest.raises(ValueError, match=r"num_experts 1000000000 must be in \[1, 4\]"):
        foremoe.export_placement(phy2log, tmp_path / "v.json", "vllm", num_experts=10**9)
    assert not (tmp_path / "v.json").exists()
