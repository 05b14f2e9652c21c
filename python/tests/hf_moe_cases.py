"""Shared by the foremoe.transformers tests: tiny Qwen3-MoE / Mixtral / OLMoE models trained with RL-style replayed
routing over gloo, once with transformers' own ``"all_to_all"`` expert parallelism (the reference) and once with
``ep_implementation="foremoe"`` under per-micro-step plans.

Not a test module (no ``test_`` prefix): the spawned ranks import it by name.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

import foremoe
from torch_moe_cases import _catch, init_group, save_and_leave

VOCAB = 64


@dataclass(frozen=True)
class HFCase:
    family: str = "qwen3_moe"  # qwen3_moe, mixtral or olmoe
    world: int = 2  # tp_size == ep_size
    experts: int = 8
    topk: int = 2
    layers: int = 2
    hidden: int = 16
    ffn: int = 8  # moe_intermediate_size
    spare: int = 2
    steps: int = 3  # RL steps (optimizer steps)
    micro: int = 2  # micro-steps per RL step (gradient accumulation)
    batch: int = 2
    seq: int = 10
    dtype: str = "float64"
    seed: int = 3
    checkpointing: bool = False  # activation recomputation in the update backward (reruns the MoE layers)
    hold: bool = True  # ForeMoE(..., hold_replica_gradients=hold)
    no_flush: bool = False  # the update micro-steps run with last=False: the optimizer step must be refused

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


def make_config(case: HFCase) -> Any:
    heads = max(2, case.world)  # tensor parallelism splits the attention heads over the ranks
    common = dict(vocab_size=VOCAB, hidden_size=case.hidden, intermediate_size=2 * case.hidden,
                  num_hidden_layers=case.layers, num_attention_heads=heads, num_key_value_heads=heads,
                  num_experts_per_tok=case.topk, tie_word_embeddings=False)
    if case.family == "qwen3_moe":
        from transformers import Qwen3MoeConfig
        return Qwen3MoeConfig(**common, head_dim=case.hidden // heads, num_experts=case.experts,
                              moe_intermediate_size=case.ffn, decoder_sparse_step=1, mlp_only_layers=[],
                              norm_topk_prob=True)
    if case.family == "mixtral":
        from transformers import MixtralConfig
        return MixtralConfig(**{**common, "intermediate_size": case.ffn}, num_local_experts=case.experts,
                             head_dim=case.hidden // heads)
    if case.family == "olmoe":
        from transformers import OlmoeConfig
        return OlmoeConfig(**{**common, "intermediate_size": case.ffn}, num_experts=case.experts, norm_topk_prob=False)
    raise ValueError(f"unknown family {case.family!r}")


def model_class(case: HFCase) -> Any:
    import transformers
    return {"qwen3_moe": transformers.Qwen3MoeForCausalLM, "mixtral": transformers.MixtralForCausalLM,
            "olmoe": transformers.OlmoeForCausalLM}[case.family]


def save_model(case: HFCase, path: str) -> None:
    """A seeded random model with sharp routers (so micro-batches of a few token kinds route unevenly)."""
    torch.manual_seed(case.seed)
    model = model_class(case)(make_config(case))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)
    model.save_pretrained(path)


def batches(case: HFCase) -> List[List[torch.Tensor]]:
    """``[step][micro]`` input ids (the same on every rank: the expert group shares the batch). Every micro-batch
    draws from its own few token kinds, so every micro-step has its own hot experts."""
    g = torch.Generator().manual_seed(case.seed + 7)
    out = []
    for _s in range(case.steps):
        row = []
        for _m in range(case.micro):
            kinds = torch.randperm(VOCAB, generator=g)[:3]
            row.append(kinds[torch.randint(0, 3, (case.batch, case.seq), generator=g)])
        out.append(row)
    return out


def load(case: HFCase, path: str, impl: str) -> Any:
    from transformers.distributed import DistributedConfig
    cfg = DistributedConfig(tp_size=case.world, ep_size=case.world, ep_implementation=impl)
    return model_class(case).from_pretrained(path, distributed_config=cfg, dtype=case.torch_dtype,
                                             experts_implementation="eager")


def setup_rank(rank: int, case: HFCase, tmp: str) -> str:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(case.world))
    init_group(rank, case.world, tmp)
    path = f"{tmp}/model"
    if rank == 0:
        save_model(case, path)
    dist.barrier()
    return path


def local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def weights(model: Any) -> Dict[str, torch.Tensor]:
    """This rank's part of every parameter (the owner rows of the experts, the local shards of the dense ones)."""
    return {n: local(p) for n, p in model.named_parameters()}


def run(case: HFCase, path: str, impl: str, spare: Optional[int] = None) -> Dict[str, Any]:
    """One rank's RL run: per step a rollout that records the routing, a recompute pass and an update pass with
    gradient accumulation (both replaying the recorded routing), an optimizer step. ``impl``: ``"all_to_all"``
    (transformers' own, unbalanced) or ``"foremoe"`` (balanced under a ReplayDriver's plans)."""
    import foremoe.transformers as fmt

    model = load(case, path, impl)
    if case.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    if impl == "foremoe":
        moe = fmt.ForeMoE(model, spare_slots=case.spare if spare is None else spare, timeout=60.0,
                          hold_replica_gradients=case.hold)
        routing = moe.routing
        planner = foremoe.Planner(moe.topology())
    else:
        moe, routing = None, fmt.RoutingReplay(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, foreach=False)
    rec: Dict[str, Any] = {"ids": [], "recompute": [], "logits": [], "loss": [], "x_grad": [], "weights": [],
                           "replica_tokens": [], "placements": [], "splits": [], "moves": 0,
                           "prefetched": 0, "held": [], "grads": [],
                           "param_names": [n for n, _ in model.named_parameters()]}
    resident = None
    for step in batches(case):
        with torch.no_grad(), routing.record() as rollout:
            for mb in step:
                model(input_ids=mb)
        ids = [rollout.ids(m) for m in range(case.micro)]
        rec["ids"].append(ids)
        driver = None
        if moe is not None:
            driver = moe.replay_driver(planner, rollout.ids(), rollout.offsets(), resident=resident, stage="recompute")

        def micro(m: int, last: Optional[bool] = None) -> Any:
            if moe is None:
                return routing.replay(ids[m])
            return moe.micro_step(driver.plan(m), ids[m], last=last)

        with torch.no_grad():
            for m, mb in enumerate(step):
                if moe is not None and m % 2 == 0:  # even micro-steps: every layer's replica moves posted ahead
                    assert driver.prefetch(m, moe.layers) is driver.plan(m)
                with micro(m):
                    rec["recompute"].append(model(input_ids=mb).logits.detach().clone())
                if moe is not None:
                    rec["moves"] += sum(st.last_sync.moves for st in moe.storages)
                    rec["prefetched"] += sum(st.last_sync.prefetched for st in moe.storages)
        if driver is not None:  # the update stage's own plans, from the recompute stage's last placement
            driver.close()
            driver = moe.replay_driver(planner, rollout.ids(), rollout.offsets(), resident=driver.last_plan)
        for m, mb in enumerate(step):
            with micro(m, last=False if case.no_flush else None):
                emb = model.get_input_embeddings()(mb)
                emb = local(emb).requires_grad_(True)
                logits = model(inputs_embeds=emb).logits
                loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), mb[:, 1:].reshape(-1))
                (loss / case.micro).backward()
            rec["logits"].append(logits.detach().clone())
            rec["loss"].append(float(loss))
            rec["x_grad"].append(emb.grad.clone())
            if moe is not None:
                plan = driver.plan(m)
                rec["replica_tokens"].append(moe.replica_tokens(plan))
                rec["placements"].append(np.asarray(plan.gpu_slots).copy())
                rec["splits"].append(np.asarray(plan.slot_tokens).copy())
                rec["moves"] += sum(st.last_sync.moves for st in moe.storages)
                rec["held"].append(moe.held_gradients())  # (layer, holder, expert) held after this backward
        if driver is not None:
            resident = driver.last_plan
            driver.close()
        rec["grads"].append({n: local(p.grad) for n, p in model.named_parameters() if p.grad is not None})
        if moe is not None and case.no_flush:  # the optimizer step must be refused, before any parameter changes
            before = weights(model)
            rec["no_flush_step"] = _catch(opt.step)
            rec["unchanged"] = all(torch.equal(w, before[n]) for n, w in weights(model).items())
            break
        opt.step()
        opt.zero_grad(set_to_none=True)
        rec["weights"].append(weights(model))
    if moe is not None:
        rec["syncs"] = [st.num_syncs for st in moe.storages]  # layer calls: one replica sync each
    return rec


def train_rank(rank: int, case: HFCase, tmp: str) -> None:
    """Both runs on one rank; writes ``{"ref": ..., "fm": ...}`` to ``tmp/rank{rank}.pt``."""
    path = setup_rank(rank, case, tmp)
    ref = run(case, path, "all_to_all")
    fm = run(case, path, "foremoe")
    save_and_leave({"ref": ref, "fm": fm}, tmp, rank)


def errors_rank(rank: int, case: HFCase, tmp: str) -> None:
    """Each bad input on every rank of the group, then a good micro-step (the group is still usable), then loading
    with an unsupported layout; writes ``{case: message}``."""
    import foremoe.transformers as fmt

    path = setup_rank(rank, case, tmp)
    out: Dict[str, str] = {}
    model = load(case, path, "foremoe")
    mb = batches(case)[0]
    out["before_attach"] = _catch(lambda: model(input_ids=mb[0]))
    out["too_many_spare"] = _catch(lambda: fmt.ForeMoE(model, spare_slots=case.experts))
    out["hold_not_bool"] = _catch(lambda: fmt.ForeMoE(model, spare_slots=case.spare, hold_replica_gradients=1))
    moe = fmt.ForeMoE(model, spare_slots=case.spare, timeout=30.0)
    out["attach_twice"] = _catch(lambda: fmt.ForeMoE(model, spare_slots=case.spare))
    with torch.no_grad(), moe.record() as rollout:
        for x in mb:
            model(input_ids=x)
    planner = foremoe.Planner(moe.topology())
    driver = moe.replay_driver(planner, rollout.ids(), rollout.offsets())
    plans = [driver.plan(m) for m in range(case.micro)]

    def step(plan: Any, ids: Any, x: torch.Tensor = mb[0]) -> None:
        with torch.no_grad(), moe.micro_step(plan, ids):
            model(input_ids=x)

    out["plan_other_micro_step"] = _catch(lambda: step(plans[1], rollout.ids(0)))
    one = foremoe.Planner(moe.topology()).plan(driver.loads[0][:1], owners=moe.owners)  # one layer only
    out["plan_one_layer"] = _catch(lambda: step(one, rollout.ids(0)))
    swapped = foremoe.Planner(moe.topology()).plan(driver.loads[0][::-1].copy(), owners=moe.owners)
    out["plan_layers_swapped"] = _catch(lambda: step(swapped, rollout.ids(0)))
    out["ids_shape"] = _catch(lambda: step(plans[0], rollout.ids(0)[:, :1]))
    out["ids_tokens"] = _catch(lambda: step(plans[0], rollout.ids(0)[:-1]))
    bad = rollout.ids(0).clone()
    bad[0, 0, 0] = case.experts
    out["ids_range"] = _catch(lambda: step(plans[0], bad))
    out["plan_type"] = _catch(lambda: step("plan", rollout.ids(0)))

    def last_not_bool() -> None:
        with moe.micro_step(plans[0], rollout.ids(0), last="yes"):
            pass

    out["last_not_bool"] = _catch(last_not_bool)

    def nested() -> None:
        with moe.micro_step(None), moe.micro_step(None):
            pass

    out["nested"] = _catch(nested)
    with torch.no_grad(), moe.micro_step(plans[0], rollout.ids(0)):
        got = model(input_ids=mb[0]).logits
    with torch.no_grad(), moe.micro_step(None, rollout.ids(0)):
        want = model(input_ids=mb[0]).logits
    out["good_after_errors"] = "equal" if torch.allclose(got, want, rtol=1e-12, atol=1e-12) else "differs"
    out["replicas_used"] = str(moe.replica_tokens(plans[0]))
    # Packing before the stage: the recorded micro-batches' rows as sequences, under the model's owners.
    import foremoe.torch as ft

    ids = rollout.ids()
    lengths = [int(x.numel()) for x in mb]
    budget = 2 * max(lengths)
    got = moe.pack(ids, lengths, micro_steps=case.micro, token_budget=budget)
    want = ft.pack_from_ids(ids, lengths, num_experts=case.experts, micro_steps=case.micro, token_budget=budget,
                            gpu_of=moe.owners)
    same = np.array_equal(got.micro_step, want.micro_step) and np.array_equal(got.loads, want.loads)
    order = sorted(i for m in got.micro_batches(0) for i in m)
    out["pack"] = "ok" if same and order == list(range(len(lengths))) else f"differs: {got.micro_step}, {order}"
    bad_ids = ids.clone()
    bad_ids[0, 0, 0] = case.experts
    out["pack_range"] = _catch(lambda: moe.pack(bad_ids, lengths, micro_steps=case.micro, token_budget=budget))
    # Unsupported layouts: FSDP2 (fsdp_size == ep_size, every rank its own batch: transformers would wrap the experts
    # in FSDP2), and an expert group that is not the tensor-parallel group without FSDP (pipeline x EP).
    from transformers.distributed import DistributedConfig
    cfg = DistributedConfig(fsdp_size=case.world, ep_size=case.world, ep_implementation="foremoe")
    out["fsdp"] = _catch(lambda: model_class(case).from_pretrained(path, distributed_config=cfg,
                                                                   dtype=case.torch_dtype))
    out["ep_not_tp"] = _catch(lambda: fmt.ForeMoEEP(model.model.layers[0].mlp.experts, moe.layers[0].ep_mesh,
                                                    _one_rank_mesh()))
    save_and_leave(out, tmp, rank)


def _one_rank_mesh() -> Any:
    """This rank alone as a 1-D CPU device mesh (a tensor-parallel group that is not the expert group)."""
    from torch.distributed.device_mesh import DeviceMesh
    return DeviceMesh.from_group(dist.new_subgroups(1)[0], "cpu")  # a collective: every rank calls it


def fsdp_rank(rank: int, case: HFCase, tmp: str) -> None:
    """FSDP2 beside tensor and expert parallelism on 4 ranks (tp_size == ep_size == 2): loading with
    ep_implementation='foremoe' is refused; with transformers' own "all_to_all" the experts are FSDP2 modules and
    ForeMoE refuses that model. Writes ``{case: message}``."""
    import foremoe.transformers as fmt
    from torch.distributed.fsdp import FSDPModule
    from transformers.distributed import DistributedConfig

    path = setup_rank(rank, case, tmp)
    out: Dict[str, str] = {}

    def load_with(impl: str, **sizes: int) -> Any:
        cfg = DistributedConfig(tp_size=2, ep_size=2, ep_implementation=impl, **sizes)
        return model_class(case).from_pretrained(path, distributed_config=cfg, dtype=case.torch_dtype,
                                                 experts_implementation="eager")

    out["fsdp"] = _catch(lambda: load_with("foremoe", fsdp_size=2))
    out["hsdp"] = _catch(lambda: load_with("foremoe", dp_replicate_size=2))
    model = load_with("all_to_all", fsdp_size=2)
    out["all_to_all_experts_fsdp"] = str(isinstance(model.model.layers[0].mlp.experts, FSDPModule))
    out["attach"] = _catch(lambda: fmt.ForeMoE(model, spare_slots=1))
    save_and_leave(out, tmp, rank)


def close(got: torch.Tensor, want: torch.Tensor, dtype: str, what: str) -> float:
    """``got`` equals ``want`` within 1e-12 (float64) or 1e-5 (float32) of ``want``'s largest magnitude; returns the
    relative error."""
    tol = 1e-12 if dtype == "float64" else 1e-5
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    scale = float(want.abs().max()) if want.numel() else 0.0
    err = float((got - want).abs().max()) if want.numel() else 0.0
    assert err <= tol * max(scale, 1e-30), f"{what}: max abs error {err:.3e} vs max |ref| {scale:.3e} (tol {tol})"
    return err / max(scale, 1e-30)


def assert_equal_runs(case: HFCase, ranks: List[Dict[str, Any]]) -> float:
    """Every rank's balanced run equals its unbalanced one: recorded routing, recompute and update logits, losses,
    input gradients, the accumulated gradients before and every weight (experts, routers, dense shards) after every
    optimizer step; the plans change
    every micro-step and give tokens to replicas. Returns the largest relative error."""
    worst = 0.0
    n = case.steps * case.micro
    for r, rec in enumerate(ranks):
        ref, fm = rec["ref"], rec["fm"]
        for s in range(case.steps):
            for m in range(case.micro):
                assert torch.equal(fm["ids"][s][m], ref["ids"][s][m]), f"rank {r} step {s} micro {m}: rollout routing"
        assert len(fm["logits"]) == len(ref["logits"]) == n
        for i in range(n):
            worst = max(worst, close(fm["recompute"][i], ref["recompute"][i], case.dtype, f"rank {r} #{i} recompute"),
                        close(fm["logits"][i], ref["logits"][i], case.dtype, f"rank {r} #{i} update logits"),
                        close(torch.tensor(fm["loss"][i]), torch.tensor(ref["loss"][i]), case.dtype,
                              f"rank {r} #{i} loss"),
                        close(fm["x_grad"][i], ref["x_grad"][i], case.dtype, f"rank {r} #{i} input grad"))
        assert len(fm["weights"]) == len(fm["grads"]) == case.steps
        for s in range(case.steps):
            # The accumulated gradients the optimizer reads (after the held replica gradients were flushed).
            assert fm["grads"][s].keys() == ref["grads"][s].keys()
            for k, want in ref["grads"][s].items():
                worst = max(worst, close(fm["grads"][s][k], want, case.dtype, f"rank {r} step {s} grad of {k}"))
            assert fm["weights"][s].keys() == ref["weights"][s].keys()
            assert any(k.endswith("experts.gate_up_proj") for k in fm["weights"][s])
            for k, want in ref["weights"][s].items():
                worst = max(worst, close(fm["weights"][s][k], want, case.dtype, f"rank {r} step {s} {k}"))
        # The optimizer saw the same parameters (the owner rows under the same names).
        assert fm["param_names"] == ref["param_names"], f"rank {r}: parameters differ"
        # Balancing really happened: every micro-step gives tokens to replicas, every plan differs from the one
        # before it (its token split; the replica placement at least once), and replicas moved.
        assert all(t > 0 for t in fm["replica_tokens"]), \
            f"rank {r}: replica tokens per micro-step {fm['replica_tokens']}"
        places, splits = fm["placements"], fm["splits"]
        for i in range(n - 1):
            assert not np.array_equal(splits[i], splits[i + 1]), f"rank {r}: micro-steps {i} and {i + 1}: same plan"
        assert any(not np.array_equal(places[i], places[i + 1]) for i in range(n - 1)), \
            f"rank {r}: the replica placement never changed"
        assert fm["moves"] > 0 and fm["prefetched"] > 0, (fm["moves"], fm["prefetched"])
        # Every MoE layer ran under ForeMoE in every forward: rollout, recompute, update; with checkpointing the
        # update backward reran it too (twice in torch 2.15: once for the decoder layer's saved tensors, once more
        # when the expert compute's inner backward unpacks its own, also saved under the checkpoint's hooks).
        calls = case.steps * case.micro * 3
        if case.checkpointing:
            assert all(c >= calls + case.steps * case.micro for c in fm["syncs"]), f"rank {r}: calls {fm['syncs']}"
        else:
            assert fm["syncs"] == [calls] * case.layers, f"rank {r}: layer calls {fm['syncs']}, expected {calls}"
    return worst


def assert_held(case: HFCase, ranks: List[Dict[str, Any]], dropped: bool = False) -> None:
    """The held replica gradients after every update micro-step, the same on every rank: with the rule on, some are
    held, some from one micro-step to the next (the plan kept the replica; with 3 or more micro-steps) and none after
    the stage's last micro-step; with
    ``dropped`` also some returned before the stage's end (a plan dropped the replica); with the rule off, none."""
    held = ranks[0]["fm"]["held"]
    assert all(rec["fm"]["held"] == held for rec in ranks), "ranks disagree on the held gradients"
    assert len(held) == case.steps * case.micro
    if not case.hold:
        assert not any(held)
        return
    steps = [held[s * case.micro:(s + 1) * case.micro] for s in range(case.steps)]
    assert all(h[-1] == [] for h in steps)  # the last micro-step's backward returned every held gradient
    assert any(held)
    if case.micro > 2:  # kept resident from one micro-step to the next before the last: still held
        assert any(set(a) & set(b) for h in steps for a, b in zip(h[:-2], h[1:-1])), held
    if dropped:
        assert any(set(a) - set(b) for h in steps for a, b in zip(h[:-2], h[1:-1])), held
