"""Shared by the foremoe.megatron tests (the spawned ranks import it by name; not a test module): a tiny Megatron
MoE model trained for a few RL steps twice in the same processes, once through foremoe.megatron and once through
Megatron's own unbalanced layer on the same replayed routing, recording what the test compares."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Dict, List

import numpy as np
import torch

import megatron_cpu as mc
from torch_moe_cases import _catch, init_group, save_and_leave


@dataclass(frozen=True)
class MCase:
    world: int = 2
    experts: int = 16
    topk: int = 2
    layers: int = 2
    hidden: int = 16
    ffn: int = 24
    spare: int = 3
    steps: int = 3  # RL steps (optimizer steps)
    micro: int = 3  # micro-batches per step (gradient accumulation)
    tokens: int = 32  # tokens of rank 0 per micro-batch (the others vary around it)
    dtype: str = "float64"
    recompute: bool = False  # activation recompute of the balanced model's MoE layers
    errors: bool = False  # also run the bad-input checks
    ddp: bool = False  # the balanced model inside Megatron's DistributedDataParallel (gradients in main_grad)
    hold: bool = True  # install(..., hold_replica_gradients=hold)
    no_flush: bool = False  # every update micro-step set with last=False: the optimizer step must be refused
    seed: int = 5  # torch's generator before the model is built (else every process draws other weights)
    module_mlp: bool = False  # experts through Megatron's MLP module (weights swapped in), not the plain-MLP path
    grouped: bool = False  # GroupedMLP experts (moe_grouped_gemm=True; the CPU stand-in for grouped_gemm.ops.gmm)
    dispatcher: str = "alltoall"  # moe_token_dispatcher_type ("allgather": every rank the same token count)
    double_buffer: bool = False  # install(..., double_buffer=True): spare rows in two copies, slots not in row order
    # Megatron's distributed optimizer on both sides: DistributedDataParallel(use_distributed_optimizer=True) and
    # get_megatron_optimizer's Adam (DistributedOptimizer), instead of torch's SGD. "before": the adapter installed
    # before the model is wrapped (its parameters then move into DDP's buffer), "after": installed on the wrapped
    # model. `refresh`: "versions" turns off the version check (only the optimizer step post-hook marks the copied
    # owner rows stale), "none" every refresh of them (the rows stay those of the first call: must differ).
    distopt: str = ""
    refresh: str = "all"
    mirror: bool = False  # install(..., mirror=True): a host mirror per rank (refreshed by the adapter with distopt)
    # With distopt: False wraps with DistributedDataParallel(use_distributed_optimizer=False) and steps
    # get_megatron_optimizer's non-distributed optimizer (bf16: Float16OptimizerWithFloat16Params, fp32 main
    # parameters), the expert parameters then keep their own memory (aliased owner rows, not copy-bound).
    distributed: bool = True
    # bfloat16 parameters train as Megatron-LM trains them (arguments.py: --bf16 sets
    # accumulate_allreduce_grads_in_fp32): DDP's main_grad in float32 (grad_reduce_in_fp32=True), the optimizer's
    # float32 main parameters (OptimizerConfig(bf16=True)). `drop_replica_grad`: test-only breakage, every replica
    # gradient of layer 0 returned as zeros in held mode (the comparison must then fail).
    drop_replica_grad: bool = False
    # Adam's epsilon with distopt (Megatron's distributed optimizer supports Adam only). Adam divides each element's
    # update by its own gradient's magnitude: with the default 1e-8 an element whose gradient is within rounding of
    # zero moves by up to 2 lr whichever way it rounds; an epsilon near the gradients' size keeps the update
    # Lipschitz in the gradient (constant lr / eps), so gradient rounding stays proportional in the weights.
    adam_eps: float = 1e-8

    @property
    def slots(self) -> int:
        return self.experts // self.world + self.spare


def micro_batch(case: MCase, step: int, m: int, rank: int) -> Dict[str, torch.Tensor]:
    """Tokens of one rank and micro-batch: noise around a direction of this micro-batch, so that the router sends
    most tokens to a few experts, other ones every micro-batch."""
    dt = getattr(torch, case.dtype)
    g = torch.Generator().manual_seed(10_000 + 100 * step + m)
    u = torch.randn(case.hidden, generator=g, dtype=dt)
    u = 3.0 * u / u.norm()
    g.manual_seed(20_000 + 1000 * step + 10 * m + rank)
    T = case.tokens if rank == 0 or case.dispatcher == "allgather" else int(torch.randint(case.tokens // 2, case.tokens * 3 // 2, (1,), generator=g))
    x = torch.randn(T, case.hidden, generator=g, dtype=dt) * 0.5 + u
    target = torch.randn(T, case.hidden, generator=g, dtype=dt)
    return {"x": x, "target": target}


def train_rank(rank: int, case: MCase, tmp: str) -> None:
    init_group(rank, case.world, tmp)
    mc.init_megatron(case.world)
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    import foremoe
    import foremoe.megatron as fmeg

    dt = getattr(torch, case.dtype)
    torch.manual_seed(case.seed)  # the same weights in every run and on every rank
    cfg = mc.make_config(layers=case.layers, hidden=case.hidden, ffn=case.ffn, experts=case.experts,
                         topk=case.topk, ep=case.world, dtype=dt, grouped=case.grouped,
                         dispatcher=case.dispatcher)
    bf16 = dt == torch.bfloat16
    ref = mc.TinyMoE(cfg)
    bal_cfg = copy.deepcopy(cfg)
    if case.recompute:
        # GroupedMLP: also its own activation recompute (CheckpointWithoutOutput) inside the layer's recompute
        bal_cfg.recompute_granularity = "selective"
        bal_cfg.recompute_modules = ["moe", "moe_act"] if case.grouped else ["moe"]
    bal = mc.TinyMoE(bal_cfg)
    bal.load_state_dict(ref.state_dict())
    run_ref, run_bal = ref, bal
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    if case.distopt:
        def wrap(c: Any, model: torch.nn.Module) -> torch.nn.Module:
            return DistributedDataParallel(c, DistributedDataParallelConfig(
                use_distributed_optimizer=case.distributed, grad_reduce_in_fp32=bf16), module=model)

        run_ref = wrap(cfg, ref)
        if case.distopt == "after":
            run_bal = wrap(bal_cfg, bal)
    fm = fmeg.install(run_bal, case.slots, timeout=60.0, hold_replica_gradients=case.hold,
                      double_buffer=case.double_buffer, mirror=case.mirror)
    if case.distopt == "before":
        run_bal = wrap(bal_cfg, bal)
    for st in fm._states:  # test-only breakage of the refresh of copied owner rows
        if case.refresh == "versions":
            st.storage._copied_versions = lambda: []
        elif case.refresh == "none":
            st.storage.refresh_copies = lambda: False
    if case.drop_replica_grad:
        from foremoe.torch import layer as fl

        st0 = fm._states[0].storage
        plain_hold = fl._return_held_grads

        def drop(run: Any, go: Any, rep_grad: Any) -> Any:
            if run.storage is st0:
                rep_grad = {j: [torch.zeros_like(t) for t in g] for j, g in rep_grad.items()}
            return plain_hold(run, go, rep_grad)

        import foremoe.megatron as fmeg_mod

        fl._return_held_grads = fmeg_mod._return_held_grads = drop
    plain = [st.plain is not None for st in fm._states]  # the local spec's MLP: the plain arithmetic
    if case.module_mlp:
        for st in fm._states:
            st.plain = None
    plain_with_hook = None
    if not case.grouped:
        expert0 = ref.layers[0].experts.local_experts[0]  # a module hook would be bypassed: the module path then
        hook = expert0.register_forward_hook(lambda *args: None)
        plain_with_hook = fmeg._plain_mlp(expert0, ["linear_fc1.weight", "linear_fc2.weight"], cfg) is not None
        hook.remove()
    if case.ddp:  # Megatron's DDP hook adds each parameter's .grad into its main_grad and clears .grad
        run_bal = DistributedDataParallel(bal_cfg, DistributedDataParallelConfig(use_distributed_optimizer=False),
                                          module=bal)
    assert all(p.data_ptr() != q.data_ptr() for p, q in zip(ref.parameters(), bal.parameters()))
    rec: Dict[str, Any] = {"cmp": [], "stats": None, "placements": [], "slot_tokens": [], "errors": {}, "held": [],
                           "param_names": [n for n, _ in bal.named_parameters()],
                           "state_dict": sorted(bal.state_dict()), "plain": plain,
                           "plain_with_hook": plain_with_hook,
                           "experts": [type(layer.experts).__name__ for layer in bal.layers],
                           "ref_experts": [type(layer.experts).__name__ for layer in ref.layers],
                           "dispatchers": [type(layer.token_dispatcher).__name__ for layer in bal.layers],
                           "ref_dispatchers": [type(layer.token_dispatcher).__name__ for layer in ref.layers]}

    def opt(model: torch.nn.Module) -> Any:
        if case.distopt:  # Megatron's DistributedOptimizer (Adam) over the DDP-wrapped model
            from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

            return get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=0.01, adam_eps=case.adam_eps,
                                                          clip_grad=0.0,
                                                          use_distributed_optimizer=case.distributed,
                                                          params_dtype=dt, bf16=bf16), [model])
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    opt_ref, opt_bal = opt(run_ref), opt(run_bal)
    planner = foremoe.Planner(fm.topology())
    resident = None

    def compare(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        rec["cmp"].append((what, got.detach().clone(), want.detach().clone()))

    for s in range(case.steps):
        batches = [micro_batch(case, s, m, rank) for m in range(case.micro)]
        # Rollout: Megatron's own layer records the routing of every micro-batch.
        mc.set_action(ref, RouterReplayAction.RECORD)
        recorded = []
        with torch.no_grad():
            for b in batches:
                ref(b["x"])
                recorded.append([r.get_recorded_indices().clone() for r in ref.routers()])
        mc.set_action(ref, RouterReplayAction.REPLAY_FORWARD)
        mc.set_action(bal, RouterReplayAction.REPLAY_FORWARD)
        # Recompute stage (log-probs): forward only.
        with fm.driver(planner, recorded, stage="recompute", resident=resident) as drv:
            for m, b in enumerate(batches):
                mc.set_targets(ref, recorded[m])
                mc.set_targets(bal, recorded[m])
                with torch.no_grad():
                    want = run_ref(b["x"])
                    with fm.micro_step(m, drv) as plan:
                        got = run_bal(b["x"])
                compare(f"step {s} recompute micro-batch {m} output", got, want)
            resident = drv.last_plan
        if case.errors and s == 0:
            rec["errors"] = bad_inputs(case, fm, bal, planner, recorded, batches)
        # Update stage: forward and backward of every micro-batch, gradients accumulated, one optimizer step.
        with fm.driver(planner, recorded, stage="update", resident=resident) as drv:
            for m, b in enumerate(batches):
                mc.set_targets(ref, recorded[m])
                mc.set_targets(bal, recorded[m])
                xr = b["x"].clone().requires_grad_(True)
                xb = b["x"].clone().requires_grad_(True)
                out_r = run_ref(xr)
                (out_r * b["target"]).sum().backward()
                with fm.micro_step(m, drv, last=False if case.no_flush else None) as plan:
                    out_b = run_bal(xb)
                    (out_b * b["target"]).sum().backward()
                rec["held"].append(fm.held_gradients())  # (layer, holder, expert) held after this backward
                rec["placements"].append(np.array(plan.gpu_slots))
                rec["slot_tokens"].append(np.array(plan.slot_tokens))
                compare(f"step {s} update micro-batch {m} output", out_b, out_r)
                compare(f"step {s} update micro-batch {m} input grad", xb.grad, xr.grad)
            resident = drv.last_plan
        if case.distopt:  # after this step's calls, before its optimizer step: rows and mirror hold the parameters
            rec.setdefault("rows_fresh", []).append(all(torch.equal(p, v) for st in fm._states
                                                        for p, v in st.storage._bound))
        if case.mirror:
            fresh = []
            for st in fm._states:
                mine = torch.from_numpy(st.storage.owned[rank])
                fresh += [not st.storage.mirror_stale()] + [
                    torch.equal(st.storage.mirror.tensors[k][mine], st.storage.storage[k][:st.storage.num_owned])
                    for k in st.storage.names]
            rec.setdefault("mirror_fresh", []).append(all(fresh))
        for (n, pb), pr in zip(bal.named_parameters(), ref.parameters()):
            if case.distopt:  # DDP's hooks accumulated every micro-step's .grad into main_grad, on both sides
                assert pb.grad is None and pr.grad is None
                compare(f"step {s} accumulated main_grad of {n}", pb.main_grad, pr.main_grad)
                continue
            if case.ddp:  # what Megatron's optimizer reads (the DP all-reduce is left out: both sides alike)
                assert pb.grad is None
                pb.grad = pb.main_grad.clone()
            compare(f"step {s} accumulated grad of {n}", pb.grad, pr.grad)
        if case.no_flush:  # the optimizer step must be refused, before any parameter changes
            before = [p.detach().clone() for p in bal.parameters()]
            if case.distopt:
                run_bal.finish_grad_sync()
            rec["no_flush_step"] = _catch(opt_bal.step)
            rec["unchanged"] = all(torch.equal(a, p) for a, p in zip(before, bal.parameters()))
            rec["changed"] = [n for a, (n, p) in zip(before, bal.named_parameters()) if not torch.equal(a, p)]
            break
        if case.distopt:  # Megatron's training step: reduce-scatter, Adam on the shards, all-gather into the buffer
            for model, o in ((run_ref, opt_ref), (run_bal, opt_bal)):
                model.finish_grad_sync()
                ok, _, _ = o.step()
                assert ok
                model.zero_grad_buffer()
                o.zero_grad()
        else:
            opt_ref.step()
            opt_bal.step()
            opt_ref.zero_grad(set_to_none=True)
            opt_bal.zero_grad(set_to_none=True)
        if case.ddp:
            run_bal.zero_grad_buffer()
        for (n, pb), pr in zip(bal.named_parameters(), ref.parameters()):
            compare(f"step {s} weight {n} after the optimizer step", pb, pr)
    rec["stats"] = fm.stats
    if case.distopt:
        rec["copy_bound"] = [st.storage.copy_bound for st in fm._states]
    save_and_leave(rec, tmp, rank)


def bad_inputs(case: MCase, fm: Any, bal: Any, planner: Any, recorded: List[List[torch.Tensor]],
               batches: List[Dict[str, torch.Tensor]]) -> Dict[str, str]:
    """Each bad input on every rank, then the group must still work (the caller goes on training)."""
    import foremoe.megatron as fmeg

    out: Dict[str, str] = {}
    with fm.driver(planner, recorded, stage="update") as drv:
        mc.set_targets(bal, recorded[0])

        def wrong_micro_step() -> None:
            with torch.no_grad(), fm.micro_step(1, drv):
                bal(batches[0]["x"])

        out["wrong_micro_step"] = _catch(wrong_micro_step)
    swapped = [list(reversed(layers)) for layers in recorded]  # layer l's plan made from layer L-1-l's routing
    with fm.driver(planner, swapped, stage="update") as drv:
        def wrong_layer() -> None:
            with torch.no_grad(), fm.micro_step(0, drv):
                bal(batches[0]["x"])

        out["wrong_layer"] = _catch(wrong_layer)
    fewer = [layers[:1] for layers in recorded]
    out["plan_too_few_layers"] = _catch(lambda: fm.driver(planner, fewer).close())
    from foremoe.torch.replay import ReplayDriver

    one = ReplayDriver.from_megatron(planner, fewer, num_experts=case.experts, owners=fm.owners, group=fm.group)
    out["plan_other_layer_count"] = _catch(lambda: fm.set_micro_step(0, one))
    one.close()
    fm.set_micro_step(None)
    kept, fm._driver = fm._driver, None
    out["set_without_driver"] = _catch(lambda: fm.set_micro_step(0))
    fm._driver = kept
    # Packing before the stage: every recorded micro-batch cut into two samples, packed under the owners; the
    # balancer's result must be foremoe.torch's on the same samples, a permutation within the budget.
    from foremoe.torch.replay import pack_from_slime

    samples = []
    for layers in recorded:
        half = layers[0].shape[0] // 2
        samples += [[x[:half] for x in layers], [x[half:] for x in layers]]
    budget = max(x[0].shape[0] for x in samples) * 2
    got = fm.pack(samples, micro_steps=len(recorded), token_budget=budget)
    want = pack_from_slime([np.stack([x.numpy() for x in layers], axis=1) for layers in samples],
                           num_experts=case.experts, micro_steps=len(recorded), token_budget=budget,
                           gpu_of=fm.owners)
    same = np.array_equal(got.micro_step, want.micro_step) and np.array_equal(got.loads, want.loads)
    order = sorted(i for mb in got.micro_batches(0) for i in mb)
    fill = [sum(samples[i][0].shape[0] for i in mb) for mb in got.micro_batches(0)]
    out["pack"] = "ok" if same and order == list(range(len(samples))) and max(fill) <= budget else \
        f"differs: {got.micro_step} vs {want.micro_step}, order {order}, fill {fill}"
    out["pack_layers"] = _catch(lambda: fm.pack([layers[:1] for layers in samples], micro_steps=2,
                                                token_budget=budget))
    out["install_twice"] = _catch(lambda: fmeg.install(bal, case.slots))
    if case.grouped:  # a GroupedMLP whose fused weight disagrees with the config: refused before any layer changes
        fresh = mc.TinyMoE(bal.layers[0].config)
        ex = fresh.layers[1].experts
        ex.weight1 = torch.nn.Parameter(ex.weight1.detach()[:, :-2].clone())
        out["grouped_shape"] = _catch(lambda: fmeg.install(fresh, case.slots))
        out["grouped_untouched"] = str([type(layer.experts).__name__ for layer in fresh.layers])
    # Megatron's distributed optimizer with overlap_param_gather=True: DDP all-gathers the parameters lazily in
    # forward pre-hooks, after the adapter would copy them: refused at install (wrapped first) or at the first
    # balanced call (installed first), on every rank.
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    def overlapped(model: Any) -> Any:
        return DistributedDataParallel(model.layers[0].config, DistributedDataParallelConfig(
            use_distributed_optimizer=True, overlap_param_gather=True), module=model)

    fresh = mc.TinyMoE(bal.layers[0].config)
    out["overlap_param_gather_after"] = _catch(lambda: fmeg.install(overlapped(fresh), case.slots))
    fresh = mc.TinyMoE(bal.layers[0].config)
    fresh_fm = fmeg.install(fresh, case.slots)
    wrapped = overlapped(fresh)
    mc.set_action(fresh, RouterReplayAction.REPLAY_FORWARD)
    mc.set_targets(fresh, recorded[0])

    def call_fresh(model: Any) -> None:
        with fresh_fm.driver(planner, recorded, stage="update") as drv:
            with torch.no_grad(), fresh_fm.micro_step(0, drv):
                model(batches[0]["x"])

    out["overlap_param_gather_before"] = _catch(lambda: call_fresh(wrapped))
    # A bound parameter whose .data is replaced by a tensor of its own (not a flat parameter buffer): still refused.
    fresh = mc.TinyMoE(bal.layers[0].config)
    fresh_fm = fmeg.install(fresh, case.slots)
    mc.set_action(fresh, RouterReplayAction.REPLAY_FORWARD)
    mc.set_targets(fresh, recorded[0])
    p = fresh.layers[0].experts.weight1 if case.grouped else fresh.layers[0].experts.local_experts[0].linear_fc1.weight
    p.data = p.data.clone()
    out["replaced_data"] = _catch(lambda: call_fresh(fresh))
    # A copy-bound parameter (the model wrapped first) whose .data is replaced after install: refused.
    fresh = mc.TinyMoE(bal.layers[0].config)
    wrapped = DistributedDataParallel(fresh.layers[0].config, DistributedDataParallelConfig(
        use_distributed_optimizer=True), module=fresh)
    fresh_fm = fmeg.install(wrapped, case.slots)
    mc.set_action(fresh, RouterReplayAction.REPLAY_FORWARD)
    mc.set_targets(fresh, recorded[0])
    out["copy_bound_fresh"] = str([st.storage.copy_bound for st in fresh_fm._states])
    p = fresh.layers[0].experts.weight1 if case.grouped else fresh.layers[0].experts.local_experts[0].linear_fc1.weight
    p.data = p.data.clone()
    out["replaced_copy_bound"] = _catch(lambda: call_fresh(wrapped))
    out["hold_not_bool"] = _catch(lambda: fmeg.install(bal, case.slots, hold_replica_gradients="yes"))
    with fm.driver(planner, recorded, stage="update") as drv:
        out["last_not_bool"] = _catch(lambda: fm.set_micro_step(0, drv, last=1))
    fm.set_micro_step(None)
    cfg = copy.deepcopy(bal.layers[0].config)
    for name, value in [("moe_token_dispatcher_type", "flex"), ("expert_tensor_parallel_size", 2),
                        ("moe_expert_capacity_factor", 1.0)]:
        bad = copy.deepcopy(cfg)
        setattr(bad, name, value)
        out[f"config_{name}_{value}"] = _catch(lambda: fmeg.check_config(bad))
    bad = copy.deepcopy(cfg)
    bad.moe_token_dispatcher_type, bad.tensor_model_parallel_size = "allgather", 2
    out["config_allgather_tp2"] = _catch(lambda: fmeg.check_config(bad))
    return out
