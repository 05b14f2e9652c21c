"""Issue 27, sizes in foremoe.torch: slot and expert counts that would allocate gigabytes are refused first."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import foremoe  # noqa: E402
from foremoe.torch import ExpertStorage, ReplayDriver  # noqa: E402


def test_expert_storage_refuses_more_slots_than_experts():
    w = {"w1": torch.zeros(2, 3)}
    with pytest.raises(ValueError, match=r"slots 1000000000 must be in \[1, 4\]"):
        ExpertStorage(w, np.array([0, 0, 1, 1]), 10**9, rank=0, world=2)


def test_replay_driver_refuses_an_expert_count_the_planner_cannot_place():
    planner = foremoe.Planner(foremoe.Topology(1, 2, 4))
    ids = np.zeros((16, 2, 2), dtype=np.int32)
    with pytest.raises(ValueError, match=r"num_experts 268435456 must be an integer in \[1, 8\]"):
        ReplayDriver.from_ids(planner, ids, [0, 8, 16], num_experts=2**28)
