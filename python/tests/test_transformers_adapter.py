"""foremoe.transformers: transformers 5.23 models with ep_implementation="foremoe" train exactly like transformers'
own expert parallelism on the same replayed routing (CPU, gloo; the ranks are spawned processes)."""

import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", minversion="5.0", reason="foremoe.transformers needs transformers >= 5 "
                    "(pinned 5.23): pip install 'foremoe[transformers]'")
if tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 7):
    pytest.skip(f"foremoe.transformers needs torch >= 2.7, found {torch.__version__}", allow_module_level=True)

import hf_moe_cases as cases  # noqa: E402
from torch_moe_cases import run_ranks  # noqa: E402


def _run(fn, case, tmp_path):
    tmp = str(tmp_path)
    run_ranks(fn, case.world, (case, tmp), tmp, timeout=240.0)
    return [torch.load(f"{tmp}/rank{r}.pt", weights_only=False) for r in range(case.world)]


def test_version_check():
    import foremoe.transformers as fmt

    assert fmt.check_transformers_version().startswith("5.23.")
    for bad in ("5.22.1", "5.24.0", "4.57.1"):
        with pytest.raises(ImportError, match=rf"supports transformers 5\.23\.x .*found transformers {bad}"):
            fmt.check_transformers_version(bad)
    assert fmt.check_transformers_version("5.23.7") == "5.23.7"
    from transformers.distributed.expert_parallel import EPImplementationInterface
    assert EPImplementationInterface()["foremoe"] is fmt.ForeMoEEP


@pytest.mark.parametrize("case", [
    cases.HFCase(family="qwen3_moe", world=2, experts=8, topk=2, spare=2, dtype="float64", checkpointing=True),
    cases.HFCase(family="mixtral", world=4, experts=16, topk=4, spare=2, dtype="float64"),
    cases.HFCase(family="olmoe", world=2, experts=8, topk=2, spare=2, dtype="float32"),
], ids=lambda c: f"{c.family}-ep{c.world}-top{c.topk}-{c.dtype}{'-checkpointing' if c.checkpointing else ''}")
def test_equals_transformers_all_to_all(case, tmp_path):
    """3 RL steps (rollout records the routing; recompute and update with 2 accumulated micro-steps replay it; SGD
    with momentum) with ep_implementation="foremoe" under a ReplayDriver's plans equal transformers' "all_to_all"
    with the same replay: logits, losses, input gradients, every weight after every step. With activation
    checkpointing the update backward reruns the MoE layers inside the micro-step, under the same plan."""
    start = time.monotonic()
    ranks = _run(cases.train_rank, case, tmp_path)
    worst = cases.assert_equal_runs(case, ranks)
    cases.assert_held(case, ranks)
    print(f"{case.family} EP{case.world}: largest relative difference {worst:.1e}, "
          f"{time.monotonic() - start:.1f} s")


HELD = {
    "spare1": cases.HFCase(family="qwen3_moe", world=2, experts=8, topk=2, spare=1, steps=2, micro=4),
    "off": cases.HFCase(family="qwen3_moe", world=2, experts=8, topk=2, spare=1, steps=2, micro=4, hold=False),
}


@pytest.mark.parametrize("name", list(HELD))
def test_held_gradients(name, tmp_path):
    """Held replica gradients over 2 ranks, float64: the run equals transformers' own (gradients before every
    optimizer step within 1e-12); gradients stay held where the next plan keeps the replica, return where a plan
    drops it before the stage's end (one spare slot), none is held after the last micro-step; with the rule off none
    is ever held."""
    case = HELD[name]
    ranks = _run(cases.train_rank, case, tmp_path)
    cases.assert_equal_runs(case, ranks)
    cases.assert_held(case, ranks, dropped=True)


def test_optimizer_step_without_flush_is_refused(tmp_path):
    """Every update micro-step with last=False: gradients stay held after the last one, the gradients differ from
    transformers' own, and the optimizer step raises naming them with every parameter unchanged."""
    case = cases.HFCase(family="qwen3_moe", world=2, experts=8, topk=2, spare=2, steps=1, micro=3, no_flush=True)
    for r, rec in enumerate(_run(cases.train_rank, case, tmp_path)):
        fm, ref = rec["fm"], rec["ref"]
        assert fm["held"][-1], f"rank {r}: nothing held after the last micro-step"
        off = [k for k, want in ref["grads"][0].items()
               if float((fm["grads"][0][k] - want).abs().max()) > 1e-12 * float(want.abs().max())]
        assert off and all(".experts." in k for k in off), (r, off)
        msg = fm["no_flush_step"]
        assert msg.startswith("RuntimeError: foremoe.transformers: optimizer step while"), msg
        layer, holder, expert = fm["held"][-1][0]
        assert f"layer {layer} expert {expert} on rank {holder}" in msg and "last=True" in msg, msg
        assert fm["unchanged"], f"rank {r}: a parameter changed"


def test_bad_input(tmp_path):
    case = cases.HFCase(family="qwen3_moe", world=2, experts=8, topk=2, spare=2, steps=1, micro=2)
    for r, out in enumerate(_run(cases.errors_rank, case, tmp_path)):
        where = f"rank {r}"
        assert out["before_attach"].startswith("RuntimeError") and "ForeMoE(model, spare_slots" in \
            out["before_attach"], where
        assert "spare_slots 8 gives 12 slots per rank, more than the 8 experts" in out["too_many_spare"], where
        assert "already has a ForeMoE attachment" in out["attach_twice"], where
        assert "hold_replica_gradients must be True or False, got 1" in out["hold_not_bool"], where
        assert "last must be True, False or None, got 'yes'" in out["last_not_bool"], where
        for k in ("plan_other_micro_step", "plan_layers_swapped"):  # caught by the loads check of the first layer
            assert out[k].startswith("ValueError") and "plan layer 0" in out[k] and "micro-step" in out[k], (where, k)
        assert "the plan has 1 layers, the model 2 MoE layers" in out["plan_one_layer"], where
        assert "ids are [20, 1, 2]" in out["ids_shape"] and "expected [tokens, 2, 2]" in out["ids_shape"], where
        assert "replayed ids have 19 tokens, MoE layer 0" in out["ids_tokens"] and "routes 20" in out["ids_tokens"]
        assert "expert id 8 outside [0, 8)" in out["ids_range"], where
        assert "plan must be a foremoe.Plan or None, got str" in out["plan_type"], where
        assert out["nested"].startswith("RuntimeError") and "do not nest" in out["nested"], where
        assert out["good_after_errors"] == "equal", where
        assert int(out["replicas_used"]) > 0, where
        assert out["pack"] == "ok", (where, out["pack"])
        assert out["pack_range"].startswith("ValueError") and "8" in out["pack_range"], (where, out["pack_range"])
        assert_fsdp_refused(out["fsdp"], "fsdp_size=2", "tp_size=1, fsdp_size=2, dp_replicate_size=1, ep_size=2")
        assert "ep_implementation='foremoe' needs" in out["ep_not_tp"] and "ep_size=2, tp_size=1" in out["ep_not_tp"]


def assert_fsdp_refused(msg, what, layout):
    """The load-time error for FSDP2 with ep_implementation='foremoe': names the setting, the layout and the
    transformers code that wraps the experts in FSDP2."""
    assert msg.startswith("ValueError: ep_implementation='foremoe' does not run with " + what), msg
    assert f"DistributedConfig({layout})" in msg, msg
    assert "transformers/distributed/fsdp.py, apply_fully_sharded_data_parallelism" in msg, msg
    assert "owner rows of an ExpertStorage" in msg and "ep_implementation='all_to_all'" in msg, msg


def test_fsdp_refused_at_load(tmp_path):
    """4 ranks: FSDP2 over the dense modules beside tensor and expert parallelism (tp_size == ep_size == 2, so the
    expert group shares a batch; fsdp_size or dp_replicate_size 2) is refused by from_pretrained with the reason
    (transformers 5.23 would wrap the experts in FSDP2 as well); the same model with transformers' own "all_to_all"
    loads with its experts FSDP2-managed (the reason holds); ForeMoE on that model refuses it too."""
    case = cases.HFCase(family="qwen3_moe", world=4, experts=8, topk=2, steps=1, micro=1)
    for r, out in enumerate(_run(cases.fsdp_rank, case, tmp_path)):
        assert_fsdp_refused(out["fsdp"], "fsdp_size=2", "tp_size=2, fsdp_size=2, dp_replicate_size=1, ep_size=2")
        assert_fsdp_refused(out["hsdp"], "dp_replicate_size=2",
                            "tp_size=2, fsdp_size=1, dp_replicate_size=2, ep_size=2")
        assert out["all_to_all_experts_fsdp"] == "True", (r, out)
        assert out["attach"].startswith("ValueError: ForeMoE: ep_implementation='foremoe' does not run with "
                                        "fsdp_size=2"), (r, out["attach"])
