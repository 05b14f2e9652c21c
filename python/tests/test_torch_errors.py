"""foremoe.torch bad input across 2 gloo ranks: clear errors naming the value on every rank (never a hang),
the group still usable afterwards, and a missing peer reported within the timeout."""

import pytest

torch = pytest.importorskip("torch", reason="skipped: PyTorch (torch) is not installed; foremoe.torch needs it")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("skipped: this torch build has no torch.distributed gloo backend", allow_module_level=True)

import torch_moe_cases as tc  # noqa: E402


@pytest.fixture(scope="module")
def messages(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("bad-input"))
    tc.run_ranks(tc.bad_input_rank, 2, (tmp,), tmp)
    return [torch.load(f"{tmp}/rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("case, culprit, text", [
    ("id_out_of_range", 1, "expert id 99 at token 3, k 1 is outside [0, 16)"),
    ("weights_shape", 0, "routing_weights must be"),
    ("x_tokens", 1, "expert_ids has"),
    ("hidden", 0, "x has hidden size 31, the experts take 32"),
])
def test_bad_local_input_fails_every_rank(messages, case, culprit, text):
    assert text in messages[culprit][case], messages[culprit][case]
    other = messages[1 - culprit][case]
    assert f"rank {culprit} of the group rejected its input" in other, other


@pytest.mark.parametrize("case, text", [
    ("plan_other_micro_step", "is this the plan of this layer and micro-step?"),
    ("plan_other_layer", "plan layer 1: "),
    ("layer_out_of_range", "layer 3 outside the plan's [0, 2) MoE layers"),
    ("plan_other_owners", "makes GPU 1 the owner of expert 0, the storage rank 0"),
])
def test_wrong_plan_fails_every_rank(messages, case, text):
    for r in range(2):
        assert text in messages[r][case], messages[r][case]
        assert messages[r][case].startswith("ValueError"), messages[r][case]
    assert "tokens over its sources but its copies get" in messages[0]["plan_other_layer"]


def test_wrong_group_size(messages):
    assert "the process group has 1 ranks, the storage was made for 2" in messages[0]["group_wrong_size"]
    assert "the plan is for 2 ranks but the process group has 1" in messages[0]["plan_for_other_group"]


def test_group_usable_after_errors(messages):
    assert [m["good_after_errors"] for m in messages] == ["equal", "equal"]


def test_missing_peer_times_out(tmp_path):
    tc.run_ranks(tc.timeout_rank, 2, (str(tmp_path),), str(tmp_path), timeout=120)
    got = torch.load(tmp_path / "rank0.pt")
    assert "did not finish within 1.5 s" in got["message"], got["message"]
    assert got["seconds"] < 30, got
