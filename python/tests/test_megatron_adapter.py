"""foremoe.megatron inside Megatron-core's MoELayer, on the CPU over gloo (CPU patches: megatron_cpu.py).

Each case trains a tiny Megatron MoE model (MoELayer blocks, SequentialMLP experts, router replay; every case again
with GroupedMLP experts) for three RL steps (rollout recording the routing, a recompute stage, an update stage of
several micro-batches with gradient accumulation and an optimizer step) through the adapter and, in the same
processes, through Megatron's own unbalanced layer on the same replayed routing: outputs, input gradients,
accumulated gradients and the weights after every optimizer step must be equal, plans must change every micro-step
and replica rows must take tokens. Two cases run Megatron's allgather dispatcher on both sides instead of the
alltoall one.

Held replica gradients (issue 30, ``hold_replica_gradients``, on by default): a replica kept resident by the next
micro-step's plan holds its gradient, one the plan drops returns it, the last micro-step returns the rest; the
accumulated gradients still equal the reference (float64 within 1e-12), with the rule off too, and without the flush
(``last=False`` on the last micro-step) the gradients differ and the optimizer step is refused.

bf16 parameters (issue 28, how verl/slime train): Megatron's optimizers with fp32 main parameters and DDP's fp32
``main_grad``, with and without the distributed optimizer; bitwise equal where the adapter runs Megatron's bf16
operations in Megatron's order, within ``BF16_TOL`` (derived below) where the replica gradient sums reorder them.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest

pytest.importorskip("torch", reason="foremoe.megatron needs torch >= 2.6")
import torch  # noqa: E402

if tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 6):
    pytest.skip(f"foremoe.megatron needs torch >= 2.6, found {torch.__version__}", allow_module_level=True)
pytest.importorskip("megatron.core", reason="foremoe.megatron needs megatron-core 0.16.1 (foremoe[megatron])")

import numpy as np  # noqa: E402

import foremoe.megatron as fmeg  # noqa: E402
from megatron_moe_cases import MCase, train_rank  # noqa: E402
from torch_moe_cases import close, run_ranks  # noqa: E402

CASES = {
    "ep2_top2_fp64": MCase(world=2, experts=16, topk=2, layers=2, dtype="float64", micro=4, errors=True,
                           ddp=True),
    "ep4_top4_fp32": MCase(world=4, experts=32, topk=4, layers=3, spare=3, tokens=24, dtype="float32",
                           recompute=True),
    "ep2_top2_fp64_spare1": MCase(world=2, experts=16, topk=2, layers=2, dtype="float64", spare=1, steps=2,
                                  micro=4),
    "ep2_top2_fp64_reduce": MCase(world=2, experts=16, topk=2, layers=2, dtype="float64", steps=2, micro=4,
                                  hold=False, module_mlp=True),
}
# Every case again with Megatron's GroupedMLP experts (fused weight1/weight2, grouped GEMM; module_mlp does not
# apply there).
CASES.update({f"grouped_{name}": replace(case, grouped=True) for name, case in list(CASES.items())})
# Double buffers: a replica may sit in the second copy of its spare row (rows past the slots), so the grouped GEMM
# runs over more rows than slots (the regrouping of slots that are not in row order: test_grouped_call_row_order).
# Megatron's allgather dispatcher (every rank all-gathers the tokens; the plan picks each rank's routes).
CASES["allgather_ep2_top2_fp64"] = MCase(world=2, experts=16, topk=2, layers=2, dtype="float64", micro=4,
                                         dispatcher="allgather", ddp=True)
CASES["grouped_allgather_ep4_top4_fp32"] = MCase(world=4, experts=32, topk=4, layers=3, spare=3, tokens=24,
                                                 dtype="float32", recompute=True, dispatcher="allgather",
                                                 grouped=True)
CASES["grouped_ep2_top2_fp64_double"] = MCase(world=2, experts=16, topk=2, layers=2, dtype="float64", steps=2,
                                              micro=4, double_buffer=True, grouped=True)
# Megatron's distributed optimizer (DDP's parameter buffer, Megatron's Adam on the shards) on both sides, the adapter
# installed before and after the wrap; fp32 (the distributed optimizer takes fp16/bf16/fp32 parameters only).
CASES["distopt_before_ep2_top2_fp32"] = MCase(world=2, experts=16, topk=2, layers=2, dtype="float32", micro=4,
                                              distopt="before")
CASES["distopt_after_ep2_top2_fp32"] = MCase(world=2, experts=16, topk=2, layers=2, dtype="float32", micro=4,
                                             distopt="after", mirror=True)
CASES["grouped_distopt_after_ep2_top2_fp32"] = MCase(world=2, experts=16, topk=2, layers=2, dtype="float32",
                                                     micro=4, distopt="after", grouped=True)
CASES["distopt_after_ep4_top4_fp32_recompute"] = MCase(world=4, experts=32, topk=4, layers=3, spare=3, tokens=24,
                                                       dtype="float32", distopt="after", recompute=True)
CASES["grouped_distopt_before_ep4_top4_fp32"] = MCase(world=4, experts=32, topk=4, layers=3, spare=3, tokens=24,
                                                      dtype="float32", distopt="before", grouped=True)
# bfloat16 parameters as verl/slime train them: Megatron's distributed optimizer (fp32 main parameters, Adam), DDP's
# main_grad in float32 (grad_reduce_in_fp32, what Megatron-LM's --bf16 sets), compared within BF16_TOL (below).
# Adam's epsilon 0.1 (the gradients' elements are O(0.1-10) here) keeps each update Lipschitz in its gradient: with
# 1e-8 an element whose gradient is within rounding of zero moves by +-lr either way (measured: 1-2 of 12288 weights
# per layer off by up to 4e-2 of the largest after the first step).
BF16 = dict(dtype="bfloat16", adam_eps=0.1)
CASES["bf16_distopt_after_ep2_top2"] = MCase(world=2, experts=16, topk=2, layers=2, micro=4, distopt="after",
                                             **BF16)
CASES["bf16_grouped_distopt_before_ep4_top4"] = MCase(world=4, experts=32, topk=4, layers=3, spare=3, tokens=24,
                                                      distopt="before", grouped=True, **BF16)
# Megatron's non-distributed bf16 optimizer (Float16OptimizerWithFloat16Params: fp32 main parameters) under DDP
# without the distributed optimizer: the expert parameters keep their memory, so the owner rows alias them.
CASES["bf16_megopt_after_ep2_top2"] = MCase(world=2, experts=16, topk=2, layers=2, micro=4, steps=2,
                                            distopt="after", distributed=False, **BF16)
NO_FLUSH = MCase(world=2, experts=16, topk=2, layers=2, dtype="float64", steps=1, micro=4, no_flush=True)


#: bf16's unit roundoff (8 significand bits): rounding to nearest changes a value by at most U_BF16 of it.
U_BF16 = 2.0 ** -8
#: Tolerance of the bf16 cases, relative to the largest magnitude of the reference tensor. Where the adapter does
#: Megatron's bf16 operations in Megatron's order the results are bitwise equal (every first-step output and input
#: gradient, and the router's gradients: asserted by test_bf16_first_step_bitwise). Where the order must differ,
#: an expert's gradient of one micro-step is Megatron's one float32-accumulated GEMM rounded to bf16 once, here
#: the owner's part and each replica's part rounded once each, the replica parts summed over the held micro-steps
#: (in float32, rounded to bf16 once when they return) and then into the owner's .grad in bf16, one rounding per
#: addition (before DDP adds .grad into the float32 main_grad): each part is at most the largest gradient element,
#: so the two sides differ by a few U_BF16 of it.
#: From the first optimizer step on the weights may differ by one bf16 rounding of an element (one ulp: up to
#: 2 U_BF16 of the largest weight), which the next steps' outputs and gradients inherit. Largest measured ratio
#: (error / largest |reference| / U_BF16): 1.94 (EP 2, SequentialMLP), 2.56 (EP 4 top-4, GroupedMLP), the same
#: with the held parts summed in bf16 (before) and in float32 (now); 4 U_BF16.
BF16_TOL = 4 * U_BF16


def _close(got, want, dtype: str, what: str) -> None:
    if dtype != "bfloat16":
        close(got, want, dtype, what)
        return
    assert got.shape == want.shape and got.dtype == want.dtype, f"{what}: {got.dtype} {tuple(got.shape)}"
    scale = float(want.float().abs().max()) if want.numel() else 0.0
    err = float((got.float() - want.float()).abs().max()) if want.numel() else 0.0
    assert err <= BF16_TOL * max(scale, 1e-30), \
        f"{what}: max abs error {err:.3e} vs max |ref| {scale:.3e} ({err / max(scale, 1e-30) / U_BF16:.2f} U_BF16)"


def _run(case: MCase, tmp_path) -> list:
    run_ranks(train_rank, case.world, (case, str(tmp_path)), str(tmp_path), timeout=180.0)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(case.world)]


_DONE: dict = {}


def _trained(name: str, tmp_path_factory) -> tuple:
    """The case's run, once per test session (every test of a case reads the same records)."""
    if name not in _DONE:
        _DONE[name] = (CASES[name], _run(CASES[name], tmp_path_factory.mktemp(name)))
    return _DONE[name]


@pytest.fixture(scope="module", params=sorted(CASES))
def trained(request, tmp_path_factory):
    return _trained(request.param, tmp_path_factory)


def test_equals_megatron_unbalanced(trained):
    case, ranks = trained
    for r, rec in enumerate(ranks):
        n_out = case.steps * case.micro * 3  # recompute output, update output, input grad
        assert len(rec["cmp"]) == n_out + 2 * case.steps * len(rec["param_names"])
        for what, got, want in rec["cmp"]:
            _close(got, want, case.dtype, f"rank {r}: {what}")


@pytest.mark.parametrize("name", sorted(n for n, c in CASES.items() if c.dtype == "bfloat16"))
def test_bf16_first_step_bitwise(tmp_path_factory, name):
    """bf16: before the first optimizer step the adapter computes Megatron's bf16 operations in Megatron's order
    wherever no replica sum intervenes: outputs, input gradients and the routers' main_grad are bitwise equal, and
    DDP's main_grad is float32 (grad_reduce_in_fp32) while parameters are bf16."""
    case, ranks = _trained(name, tmp_path_factory)
    differs = []
    for r, rec in enumerate(ranks):
        first = [c for c in rec["cmp"] if c[0].startswith("step 0 ")]
        exact = [c for c in first if " output" in c[0] or "input grad" in c[0] or ".router." in c[0]
                 and "main_grad" in c[0]]
        assert exact
        for what, got, want in exact:
            assert torch.equal(got, want), f"rank {r}: {what} not bitwise equal"
        grads = [c for c in first if "main_grad" in c[0]]
        weights = [c for c in first if "after the optimizer step" in c[0]]
        assert grads and all(got.dtype == torch.float32 for _, got, _ in grads)
        assert weights and all(got.dtype == torch.bfloat16 for _, got, _ in weights)
        differs.append(any(not torch.equal(got, want) for what, got, want in grads if ".router." not in what))
    # the replica sums do change some rank's expert gradients in their last bits (else this test checks nothing)
    assert any(differs)


def test_bf16_tolerance_catches_a_dropped_replica_gradient(tmp_path):
    """The bf16 tolerance can fail: the same EP 2 case with every replica gradient of layer 0 returned as zeros."""
    case = replace(CASES["bf16_distopt_after_ep2_top2"], steps=1, drop_replica_grad=True)
    ranks = _run(case, tmp_path)
    failed = []
    for r, rec in enumerate(ranks):
        for what, got, want in rec["cmp"]:
            try:
                _close(got, want, case.dtype, f"rank {r}: {what}")
            except AssertionError:
                failed.append(what)
    assert any("layers.0.experts" in w and "main_grad" in w for w in failed), failed
    assert not any("layers.1." in w for w in failed if "main_grad" in w), failed  # layer 1 was left alone


def test_plain_mlp_path(trained):
    """The local spec's expert MLP runs as the plain arithmetic (the same operations as Megatron's MLP module,
    without the module calls); one case runs Megatron's module with the weights swapped in, and both equal the
    reference (test_equals_megatron_unbalanced). The grouped cases run GroupedMLP on both sides."""
    case, ranks = trained
    for rec in ranks:
        kind = "AllGather" if case.dispatcher == "allgather" else "AlltoAll"
        assert rec["ref_dispatchers"] == [f"MoE{kind}TokenDispatcher"] * case.layers
        assert rec["dispatchers"] == [f"ForeMoE{kind}TokenDispatcher"] * case.layers
        if case.grouped:
            assert rec["ref_experts"] == ["GroupedMLP"] * case.layers
            assert rec["experts"] == ["_BalancedGroupedMLP"] * case.layers
            continue
        assert rec["ref_experts"] == ["SequentialMLP"] * case.layers
        assert rec["plain"] and all(rec["plain"])
        assert not rec["plain_with_hook"]


def test_held_gradients(trained):
    """Gradients are held across micro-steps where the plans keep a replica, returned where a plan drops it before
    the stage ends, and none is held after the last micro-step (with the rule off: none ever)."""
    case, ranks = trained
    held = ranks[0]["held"]
    assert all(rec["held"] == held for rec in ranks), "ranks disagree on the held gradients"
    assert len(held) == case.steps * case.micro
    if not case.hold:
        assert not any(held)
        return
    steps = [held[s * case.micro:(s + 1) * case.micro] for s in range(case.steps)]
    assert all(h[-1] == [] for h in steps)  # flushed by the last micro-step's backward
    assert any(set(a) & set(b) for h in steps for a, b in zip(h, h[1:]))  # kept resident: still held
    if case.spare == 1:  # one spare slot: a plan drops a held replica before the stage's end, which returns it
        assert any(set(a) - set(b) for h in steps for a, b in zip(h[:-2], h[1:-1]))


@pytest.mark.parametrize("grouped,distopt,dtype", [(False, "", "float64"), (True, "", "float64"),
                                                   (False, "after", "float32"), (False, "after", "bfloat16")],
                         ids=["sequential", "grouped", "distopt", "distopt_bf16"])
def test_optimizer_step_without_flush_is_refused(tmp_path, grouped, distopt, dtype):
    """The last micro-step run with last=False: gradients stay held, the accumulated gradients differ from the
    reference, and the optimizer step raises naming them, with every parameter unchanged (also Megatron's
    distributed optimizer, fp32: its inner step over shards of DDP's parameter buffer; bf16: over the fp32
    main_param shards)."""
    case = replace(NO_FLUSH, grouped=grouped, distopt=distopt, dtype=dtype)
    ranks = _run(case, tmp_path)
    for r, rec in enumerate(ranks):
        assert rec["held"][-1], "nothing held after the last micro-step"
        grads = [c for c in rec["cmp"] if "accumulated " in c[0]]
        assert grads
        off = [what for what, got, want in grads
               if float((got - want).abs().max()) > 1e-12 * float(want.abs().max())]
        assert off, f"rank {r}: the unflushed gradients equal the reference (nothing was held?)"
        msg = rec["no_flush_step"]
        assert msg.startswith("RuntimeError: foremoe.megatron: optimizer step while"), msg
        layer, holder, expert = rec["held"][-1][0]
        assert f"layer {layer} expert {expert} on rank {holder}" in msg
        assert "last=True" in msg and "hold_replica_gradients=False" in msg
        if distopt:  # Megatron's ChainedOptimizer steps the dense parameters' optimizer before the experts' one
            assert rec["changed"] and all(".router." in n for n in rec["changed"]), rec["changed"]
        else:
            assert rec["unchanged"]


def test_distributed_optimizer_copies(trained):
    """With Megatron's distributed optimizer the expert parameters live in DDP's parameter buffer: every layer's owner
    rows are copies (copy-bound), whichever order the adapter and the wrap came in; otherwise they alias."""
    case, ranks = trained
    for rec in ranks:
        if case.distopt:
            assert rec["copy_bound"] == [case.distributed] * case.layers
            assert rec["rows_fresh"] == [True] * case.steps  # the copied owner rows equal the parameters
        else:
            assert "copy_bound" not in rec
        if case.mirror:  # refreshed by the adapter after each optimizer step: holds the owners' current rows
            assert rec["mirror_fresh"] == [True] * case.steps


@pytest.mark.parametrize("refresh", ["versions", "none"])
@pytest.mark.parametrize("grouped", [False, True], ids=["sequential", "grouped"])
def test_distributed_optimizer_refresh(tmp_path, grouped, refresh):
    """The copied owner rows follow each optimizer step. "versions": the parameters' version counters ignored, the
    optimizer step post-hook alone marks them stale, and every step still equals the reference. "none": the rows
    never refreshed after the first call: the first step equals the reference, every later step's outputs do not
    (the test can fail)."""
    case = replace(CASES["distopt_before_ep2_top2_fp32"], steps=2, micro=2, refresh=refresh, grouped=grouped)
    ranks = _run(case, tmp_path)
    for r, rec in enumerate(ranks):
        def off(what: str, got, want) -> bool:
            return float((got - want).abs().max()) > 1e-5 * max(1.0, float(want.abs().max()))

        first = [c for c in rec["cmp"] if c[0].startswith("step 0 ")]
        later = [c for c in rec["cmp"] if c[0].startswith("step 1 ") and " output" in c[0]]
        assert first and later
        assert not any(off(*c) for c in first), f"rank {r}: step 0 differs"
        if refresh == "versions":
            assert not any(off(*c) for c in rec["cmp"]), f"rank {r}: the post-hook alone did not refresh"
        else:
            assert all(off(*c) for c in later), f"rank {r}: stale owner rows gave the reference's outputs"


def test_replicas_used_and_plans_change(trained):
    case, ranks = trained
    stats = [s for rec in ranks for s in rec["stats"]]
    # Every balanced layer call of every rank: the recompute stage's forward, the update stage's forward and, with
    # activation recompute, its recomputation in the backward (under the same micro-step's plan).
    calls = 1 + (2 if case.recompute else 1)
    assert len(stats) == case.world * calls * case.steps * case.micro * case.layers
    assert sum(s["replica_tokens"] for s in stats) > 0
    assert sum(s["replica_rows"] for s in stats) > 0
    # The plans balance: the busiest rank under the plan never carries more than under Megatron's sharding.
    assert all(s["max"] <= s["max_plain"] for s in stats)
    assert any(s["max"] < s["max_plain"] for s in stats)
    tokens = ranks[0]["slot_tokens"]
    assert all(not np.array_equal(a, b) for a, b in zip(tokens, tokens[1:]))
    place = ranks[0]["placements"]
    assert any(not np.array_equal(a, b) for a, b in zip(place, place[1:]))


def test_parameters_unchanged(trained):
    case, ranks = trained
    fused = (".experts.weight1", ".experts.weight2") if case.grouped else ()
    for rec in ranks:
        assert all(".local_experts." in n or ".router." in n or n.endswith(fused) for n in rec["param_names"])
        assert case.grouped == any(n.endswith(".experts.weight1") for n in rec["param_names"])
        assert not any("foremoe" in k or "storage" in k for k in rec["state_dict"])


@pytest.mark.parametrize("name", ["ep2_top2_fp64", "grouped_ep2_top2_fp64"])
def test_bad_input(tmp_path_factory, name):
    case, ranks = _trained(name, tmp_path_factory)  # the bad inputs ran in the EP 2 case's first step
    for rec in ranks:
        if case.grouped:  # layer 1's weight1 two columns short: named with the shapes, nothing installed
            n, f1 = case.experts // case.world, 2 * case.ffn
            want = (f"ValueError: foremoe.megatron: MoE layer 1: GroupedMLP weight1 is [{case.hidden}, {n * f1 - 2}], "
                    f"expected [{case.hidden}, {n * f1}] (hidden {case.hidden}, {n} local experts, "
                    f"moe_ffn_hidden_size {case.ffn}, gated")
            assert rec["errors"]["grouped_shape"].startswith(want), rec["errors"]["grouped_shape"]
            assert rec["errors"]["grouped_untouched"] == "['GroupedMLP', 'GroupedMLP']"
        e = rec["errors"]
        assert e["wrong_micro_step"].startswith("ValueError: foremoe.megatron: MoE layer 0, micro-step 1:")
        assert "is this the plan of this layer and micro-step?" in e["wrong_micro_step"]
        assert e["wrong_layer"].startswith("ValueError: foremoe.megatron: MoE layer 0, micro-step 0:")
        assert "plan layer 0" in e["wrong_layer"]
        assert "MoE layers" in e["plan_too_few_layers"]
        assert "1 MoE layers, the model 2" in e["plan_other_layer_count"]
        assert "without a driver" in e["set_without_driver"]
        assert e["pack"] == "ok", e["pack"]
        assert "sample 0 has 1 per-layer arrays, the model 2 MoE layers" in e["pack_layers"]
        assert "already balanced" in e["install_twice"]
        overlap = ("ValueError: foremoe.megatron: MoE layer 0: Megatron's DistributedDataParallel gathers the "
                   "parameters lazily in forward pre-hooks (DistributedDataParallelConfig(overlap_param_gather=True))")
        assert e["overlap_param_gather_after"].startswith(overlap), e["overlap_param_gather_after"]
        assert e["overlap_param_gather_before"].startswith(overlap.replace("layer 0:", "layer 0, micro-step 0: "
                                                                           "foremoe.megatron: MoE layer 0:")), \
            e["overlap_param_gather_before"]
        assert e["replaced_data"].startswith(
            "ValueError: foremoe.megatron: MoE layer 0, micro-step 0: ExpertStorage: a bound trainer parameter no "
            "longer aliases its slot storage row (its .data was replaced"), e["replaced_data"]
        assert e["copy_bound_fresh"] == "[True, True]"
        assert e["replaced_copy_bound"].startswith(
            "ValueError: foremoe.megatron: MoE layer 0, micro-step 0: ExpertStorage: a copy-bound trainer parameter's "
            ".data was replaced since it was bound"), e["replaced_copy_bound"]
        assert "hold_replica_gradients must be True or False, got 'yes'" in e["hold_not_bool"]
        assert "last must be True, False or None, got 1" in e["last_not_bool"]
        assert "moe_token_dispatcher_type='flex'" in e["config_moe_token_dispatcher_type_flex"]
        assert e["config_allgather_tp2"].startswith("ValueError: foremoe.megatron: tensor_model_parallel_size=2 with "
                                                    "moe_token_dispatcher_type='allgather' is not supported")
        assert "expert_tensor_parallel_size=2" in e["config_expert_tensor_parallel_size_2"]
        assert "moe_expert_capacity_factor=1.0" in e["config_moe_expert_capacity_factor_1.0"]


def test_version_errors():
    with pytest.raises(ImportError, match=r"supports megatron-core 0\.16\.1, found megatron-core 0\.15\.0"):
        fmeg.check_versions(megatron_version="0.15.0")
    with pytest.raises(ImportError, match=r"needs torch >= 2\.6 .*found torch 1\.13\.1"):
        fmeg.check_versions(torch_version="1.13.1", megatron_version="0.16.1")
    fmeg.check_versions()  # the installed versions are the supported ones


def test_import_without_megatron():
    """Without megatron-core, importing the adapter is an ImportError naming the package and version to install."""
    code = ("import sys; sys.modules['megatron'] = None\n"
            "try:\n    import foremoe.megatron\nexcept ImportError as e:\n    print('ImportError:', e)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "ImportError: foremoe.megatron needs megatron-core 0.16.1" in r.stdout, r.stdout
    assert "pip install 'megatron-core==0.16.1'" in r.stdout


def test_optimizer_guard_covers_main_param_copies():
    """The guard refuses a step of an optimizer over the guarded parameters or over their ``main_param`` copies
    (Megatron's mixed-precision optimizer steps those) while a gradient is held, and lets every other step run."""
    from types import SimpleNamespace

    from foremoe.torch import held

    class Holder:
        def __init__(self) -> None:
            self.storages = [SimpleNamespace(_held={}, _held_grads={}, rank=0),
                             SimpleNamespace(_held={(1, 3): 0}, _held_grads={}, rank=0)]
            self.param = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
            self.param.main_param = torch.nn.Parameter(torch.zeros(2))

        def guarded_parameters(self) -> list:
            return [self.param]

        def held_error(self, got: list) -> str:
            return f"held {got}"

    h = Holder()
    held.guard_optimizer_steps(h)
    main = h.param.main_param
    main.grad = torch.ones(2)
    opt = torch.optim.SGD([main], lr=0.5)
    with pytest.raises(RuntimeError, match=r"^held \[\(1, 1, 3\)\]$"):
        opt.step()
    assert torch.equal(main, torch.zeros(2))  # refused before the step changed anything
    other = torch.nn.Parameter(torch.zeros(1))
    other.grad = torch.ones(1)
    torch.optim.SGD([other], lr=0.5).step()  # not the holder's parameters: runs
    assert torch.equal(other.detach(), torch.full((1,), -0.5))
    h.storages[1]._held.clear()
    h.storages[0]._held_grads[7] = [torch.zeros(1)]  # a gradient accumulated on this rank, not yet returned
    with pytest.raises(RuntimeError, match=r"^held \[\(0, 0, 7\)\]$"):
        opt.step()
    h.storages[0]._held_grads.clear()
    opt.step()  # nothing held: the step runs
    assert torch.equal(main.detach(), torch.full((2,), -0.5))
    # Megatron's distributed optimizer steps fp32 parameters as shards, views of DDP's buffer where the parameter's
    # .data lives: a shard overlapping a guarded parameter is refused, a disjoint one runs.
    flat = torch.zeros(8)
    h.param = torch.nn.Parameter(flat[2:6])
    h.storages[0]._held_grads[7] = [torch.zeros(1)]
    shard = torch.nn.Parameter(flat[5:8])
    shard.grad = torch.ones(3)
    with pytest.raises(RuntimeError, match=r"^held \[\(0, 0, 7\)\]$"):
        torch.optim.SGD([shard], lr=0.5).step()
    other = torch.nn.Parameter(flat[6:8])
    other.grad = torch.ones(2)
    torch.optim.SGD([other], lr=0.5).step()
    assert torch.equal(flat[6:8], torch.full((2,), -0.5))


def test_spread_and_collect_with_unrouted_routes():
    """The dispatch's gathers with tokens of fewer than K routes (padding): ``_Collect`` equals the zero-filled
    ``index_copy`` combine and ``_Spread`` the ``index_select`` send, forward and backward (float64)."""
    g = torch.Generator().manual_seed(3)
    T, K, H = 7, 3, 5
    routed = torch.rand(T * K, generator=g) > 0.3
    routed[0] = False  # at least one route not sent
    order = routed.nonzero().view(-1)[torch.randperm(int(routed.sum()), generator=g)]  # the send order
    route_pos = torch.full((T * K,), -1, dtype=torch.long)
    route_pos[order] = torch.arange(order.numel())
    gather = torch.where(route_pos < 0, torch.full_like(route_pos, order.numel()), route_pos)
    send_tokens = order // K
    back = torch.randn(order.numel(), H, dtype=torch.float64, generator=g, requires_grad=True)
    got = fmeg._Collect.apply(back, send_tokens, gather, True, T, K)
    want = back.new_zeros((T * K, H)).index_copy(0, order, back).view(T, K, H).sum(dim=1)
    assert torch.equal(got, want)
    gy = torch.randn(T, H, dtype=torch.float64, generator=g)
    assert torch.equal(torch.autograd.grad(got, back, gy)[0], torch.autograd.grad(want, back, gy)[0])
    x = torch.randn(T, H, dtype=torch.float64, generator=g, requires_grad=True)
    sent = fmeg._Spread.apply(x, send_tokens, gather, True, K)
    assert torch.equal(sent, x.index_select(0, send_tokens))
    gs = torch.randn(order.numel(), H, dtype=torch.float64, generator=g)
    got_gx = torch.autograd.grad(sent, x, gs)[0]
    want_gx = torch.autograd.grad(x.index_select(0, send_tokens), x, gs)[0]
    torch.testing.assert_close(got_gx, want_gx, rtol=1e-12, atol=1e-12)
    # With Megatron's [T, E] routing weights: each sent row's weight in the same node, equal to the flat gather
    # forward and backward (its gradient added into zeros at the index, as index_select's backward does).
    E = 4
    probs = torch.rand(T, E, dtype=torch.float64, generator=g).requires_grad_(True)
    prob_index = send_tokens * E + torch.randint(0, E, (order.numel(),), generator=g)
    prob_index = prob_index.unique()[torch.randperm(prob_index.unique().numel(), generator=g)]
    rows = send_tokens[: prob_index.numel()]
    sent, sent_probs = fmeg._Spread.apply(x, rows, gather.clamp(max=rows.numel()), True, K, probs, prob_index)
    want_probs = probs.reshape(-1).index_select(0, prob_index)
    assert torch.equal(sent, x.index_select(0, rows)) and torch.equal(sent_probs, want_probs)
    gp = torch.randn(prob_index.numel(), dtype=torch.float64, generator=g)
    got_gp = torch.autograd.grad((sent_probs * gp).sum() + sent.sum(), probs)[0]
    assert torch.equal(got_gp, torch.autograd.grad((want_probs * gp).sum(), probs)[0])
    # _Rows moves the tokens and their weights in one node; backward gathers with the inverse permutation.
    perm = torch.randperm(T, generator=g)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(T)
    a, b = fmeg._Rows.apply(perm, inverse, x, probs)
    assert torch.equal(a, x[perm]) and torch.equal(b, probs[perm])
    ga, gb = torch.randn_like(a), torch.randn_like(b)
    got = torch.autograd.grad((a * ga).sum() + (b * gb).sum(), [x, probs])
    want = torch.autograd.grad((x[perm] * ga).sum() + (probs[perm] * gb).sum(), [x, probs])
    assert all(torch.equal(u, v) for u, v in zip(got, want))


@pytest.mark.parametrize("seed", range(20))
def test_grouped_call_row_order(seed):
    """GroupedMLP's regrouping of the received rows (``_core.group_by_storage_row``, what ``_prepare_call`` hands
    the expert module; ``_by_row`` for the allgather path) on random instances: the received rows are grouped by
    storage row, ascending (the slot blocks reordered when the plan's slots are not in row order), ``counts`` has
    each used slot's count at its row and zeros elsewhere, and ``recv_inverse`` inverts ``recv_perm``."""
    from types import SimpleNamespace

    from foremoe import _core

    rng = np.random.default_rng(seed)
    S = int(rng.integers(1, 9))
    rows_total = S + int(rng.integers(0, 4))
    rows = rng.permutation(rows_total)[:S]
    counts = rng.integers(0, 5, S) * (rng.random(S) < 0.7)
    rows = np.where(counts > 0, rows, np.where(rng.random(S) < 0.5, -1, rows))  # an empty slot may have no row
    N = int(counts.sum())
    recv_perm = torch.from_numpy(rng.permutation(N))
    slot_counts = [int(c) for c in counts]
    got_counts, got_perm, got_inverse, reordered = _core.group_by_storage_row(
        np.asarray(slot_counts, dtype=np.int64), rows.astype(np.int64), rows_total, recv_perm.numpy())
    by_slot = recv_perm.split(slot_counts)  # received row ids grouped by slot (Megatron's SequentialMLP order)
    order = sorted((j for j in range(S) if counts[j] > 0), key=lambda j: rows[j])
    want = [by_slot[j] for j in order]
    want = torch.cat(want) if want else torch.zeros(0, dtype=torch.long)
    assert torch.equal(torch.from_numpy(got_perm), want)
    assert reordered == (order != sorted(order))
    assert torch.equal(torch.from_numpy(got_inverse)[want], torch.arange(N))
    want_counts = np.zeros(rows_total, dtype=np.int64)
    want_counts[rows[counts > 0]] = counts[counts > 0]
    assert got_counts.dtype == np.int64 and got_counts.tolist() == want_counts.tolist()
    # The allgather path's permutation of the slot-grouped rows: the same regrouping of the identity.
    run = SimpleNamespace(layout=SimpleNamespace(slot_counts=slot_counts), rows=rows)
    row_counts, perm = fmeg._by_row(run, rows_total)
    assert row_counts.tolist() == want_counts.tolist()
    ident = torch.arange(N).split(slot_counts)
    want_perm = torch.cat([ident[j] for j in order]) if order else torch.zeros(0, dtype=torch.long)
    assert (perm is None) == (order == sorted(order))
    assert torch.equal(torch.arange(N) if perm is None else perm, want_perm)
    plain, none = fmeg._by_row(run, None)  # SequentialMLP: slot order kept
    assert none is None and plain.tolist() == slot_counts


@pytest.mark.parametrize("seed", range(10))
def test_adapter_layout_matches_local_layout(seed):
    """``_adapter_layout`` (one ``_core.adapter_dispatch`` call) on random skewed routing with dropped routes: every
    field equals ``foremoe.torch``'s ``local_layout`` for the same plan, ids and gathered loads; the combine gather is
    ``route_pos`` with an unsent route on the zero row past the sent ones; the probability index is
    ``send_tokens * E + send_experts``; ``_make_call`` regroups by storage row as ``group_by_storage_row`` does."""
    from types import SimpleNamespace

    import foremoe
    from foremoe.torch.distributed import local_layout

    rng = np.random.default_rng(seed)
    G = int(rng.integers(2, 4))
    E = G * int(rng.integers(2, 5))
    S = E // G + int(rng.integers(1, 3))
    K = int(rng.integers(1, min(3, E) + 1))
    pop = np.exp(1.5 * rng.standard_normal(E))
    ids = []
    for r in range(G):
        T = int(rng.integers(1, 40))
        a = np.stack([rng.choice(E, K, replace=False, p=pop / pop.sum()) for _ in range(T)]).astype(np.int32)
        if seed % 2:
            a[rng.random(a.shape) < 0.15] = -1  # tokens with fewer routes than top-k
        ids.append(torch.from_numpy(a))
    loads = np.zeros((E, G), np.int64)
    for r in range(G):
        v = ids[r].numpy().reshape(-1)
        loads[:, r] = np.bincount(v[v >= 0], minlength=E)
    owners = np.repeat(np.arange(G), E // G).astype(np.int32)
    plan = foremoe.Planner(foremoe.Topology(1, G, S)).plan(loads.sum(1)[None], owners=owners)
    flags = np.zeros((G, 4), np.int64)
    for rank in range(G):
        got, extra = fmeg._adapter_layout(plan, 0, ids[rank], loads, rank, flags, S)
        want = local_layout(plan, 0, ids[rank], loads, rank, flags=flags)
        for name in ("slots", "order", "send_tokens", "recv_perm", "recv_inverse", "send_experts", "route_pos"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        for name in ("input_splits", "output_splits", "slot_counts", "rank", "world", "num_experts", "slots_per_rank"):
            assert getattr(got, name) == getattr(want, name), name
        assert np.array_equal(got.source_split, want.source_split)
        gather, prob_index, padded, counts = extra
        unsent = want.route_pos < 0
        assert padded == bool(unsent.any())
        assert torch.equal(gather, torch.where(unsent, torch.full_like(want.route_pos, want.num_send), want.route_pos))
        assert torch.equal(prob_index, want.send_tokens * E + want.send_experts.to(torch.int64))
        assert counts.tolist() == want.slot_counts
        rows = rng.permutation(S).astype(np.int64)
        c = fmeg._make_call(SimpleNamespace(layout=got, rows=rows), extra, torch.Size([want.slots.shape[0], 4]), 0, S,
                            torch.device("cpu"))
        row_counts, perm, inverse, _ = _core_group(want, rows, S)
        assert c.counts.tolist() == row_counts.tolist() and c.recv_perm.tolist() == perm.tolist()
        assert c.recv_inverse.tolist() == inverse.tolist() and c.pad == padded


def _core_group(layout, rows, S):
    from foremoe import _core

    return _core.group_by_storage_row(np.asarray(layout.slot_counts, dtype=np.int64), rows, S,
                                      layout.recv_perm.numpy())


def test_layout_remembered_by_content():
    """``_remembered_layout`` (what a layer call reuses from the last one) on random sequences of calls that repeat
    routing as new objects (the plan too), permute the tokens under the same loads, change the plan's tokens per
    slot under the same placement, or change the loads: every layout equals one made afresh (``_adapter_layout``),
    with this call's flags, and the remembered arrays are reused exactly when the plan's layer, the loads and the
    ids are equal."""
    from types import SimpleNamespace

    import foremoe

    rng = np.random.default_rng(5)
    G, E, K, T = 2, 8, 2, 30
    S = E // G + 2
    owners = np.repeat(np.arange(G), E // G).astype(np.int32)
    planners = [foremoe.Planner(foremoe.Topology(1, G, S)), foremoe.Planner(foremoe.Topology(1, G, S), move_budget=0)]
    pop = np.exp(1.5 * rng.standard_normal(E))

    def routing():
        ids = [np.stack([rng.choice(E, K, replace=False, p=pop / pop.sum()) for _ in range(T)]).astype(np.int32)
               for _ in range(G)]
        loads = np.stack([np.bincount(a.reshape(-1), minlength=E) for a in ids], axis=1).astype(np.int64)
        return ids, loads

    def content(plan):
        return np.asarray(plan.gpu_slots[0]).tobytes() + np.asarray(plan.slot_tokens[0]).tobytes()

    st = SimpleNamespace(memo=None, plan_key=None, rank=0, storage=SimpleNamespace(slots=S))
    ids, loads = routing()
    which, last, reused, kinds = 0, None, 0, set()
    for step in range(80):
        kind = str(rng.choice(["same", "permuted", "plan", "new"]))
        if kind == "permuted":  # the same counts, the tokens in another order
            ids = [a[rng.permutation(T)] for a in ids]
        elif kind == "plan":  # the same routing under another plan (another planner: owners only)
            which = 1 - which
        elif kind == "new":
            ids, loads = routing()
        plan = planners[which].plan(loads.sum(1)[None], owners=owners)  # a new plan object every call
        t = torch.from_numpy(ids[0].copy())  # a new tensor every call, as _routes makes
        flags = rng.integers(0, 2, (G, 4))
        got, extra, memo = fmeg._remembered_layout(st, plan, 0, t, loads, 0, flags)
        want, want_extra = fmeg._adapter_layout(plan, 0, t, loads, 0, flags, S)
        for name in ("slots", "order", "send_tokens", "recv_perm", "recv_inverse", "send_experts", "route_pos"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (step, kind, name)
        for name in ("input_splits", "output_splits", "slot_counts"):
            assert getattr(got, name) == getattr(want, name), (step, kind, name)
        assert np.array_equal(got.source_split, want.source_split) and got.flags is flags
        assert all(torch.equal(a, b) for a, b in zip(extra[:2], want_extra[:2])) and extra[2] == want_extra[2]
        assert extra[3].tolist() == want_extra[3].tolist()
        same = (last is not None and np.array_equal(last[0], loads) and np.array_equal(last[1], ids[0])
                and last[2] == content(plan))
        assert (extra is last[3]) == same if last else not same, (step, kind)
        reused += same
        kinds.add((kind, same))
        last = (loads.copy(), ids[0].copy(), content(plan), extra)
    assert reused >= 5 and ("permuted", False) in kinds and ("plan", False) in kinds
