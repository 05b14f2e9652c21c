"""Shared by the foremoe.torch tests: a tiny seeded MoE training run, once across processes over gloo with the
balanced layer and once in one process without replication (the reference), plus the process launcher.

Not a test module (no ``test_`` prefix): the spawned ranks import it by name.
"""

from __future__ import annotations

import datetime
import os
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import foremoe
import foremoe.torch as ft


@dataclass(frozen=True)
class Case:
    world: int = 2
    experts: int = 16
    topk: int = 2
    hidden: int = 32
    ffn: int = 48
    spare: int = 3  # replica slots per rank beyond the owned experts
    nodes: int = 1
    steps: int = 3  # RL steps (optimizer steps)
    micro: int = 3  # micro-steps per RL step (gradient accumulation)
    tokens: int = 40  # mean tokens per rank and micro-step
    dtype: str = "float64"
    seed: int = 1
    skew: float = 2.0
    plain: Tuple[Tuple[int, int], ...] = ()  # (step, micro-step) run as plain expert parallelism (plan=None)

    @property
    def slots(self) -> int:
        return self.experts // self.world + self.spare

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


def make_data(case: Case) -> List[List[List[Dict[str, torch.Tensor]]]]:
    """``data[step][micro][rank]``: x, ids, routing logits and the loss target of every rank's tokens."""
    g = torch.Generator().manual_seed(case.seed + 1000)
    rng = np.random.default_rng(case.seed)
    dt = case.torch_dtype
    out = []
    for _s in range(case.steps):
        step = []
        for _m in range(case.micro):
            # A new skewed expert popularity every micro-step, so every plan differs.
            pop = np.exp(case.skew * rng.standard_normal(case.experts))
            pop = torch.from_numpy(pop / pop.sum())
            ranks = []
            for r in range(case.world):
                T = int(rng.integers(case.tokens // 2, case.tokens * 3 // 2 + 1)) if r else case.tokens
                ids = torch.multinomial(pop.expand(T, -1), case.topk, replacement=False, generator=g)
                drop = torch.rand(T, case.topk, generator=g) < 0.05
                ids[drop] = -1
                ranks.append(dict(
                    x=torch.randn(T, case.hidden, generator=g, dtype=dt),
                    ids=ids,
                    logits=torch.randn(T, case.topk, generator=g, dtype=dt),
                    target=torch.randn(T, case.hidden, generator=g, dtype=dt),
                ))
            step.append(ranks)
        out.append(step)
    return out


def make_experts(case: Case) -> ft.SwiGLUExperts:
    g = torch.Generator().manual_seed(case.seed)
    return ft.SwiGLUExperts(case.experts, case.hidden, case.ffn, dtype=case.torch_dtype, generator=g)


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def step_loads(case: Case, step: List[List[Dict[str, torch.Tensor]]]) -> np.ndarray:
    """``[M, 1, E]`` loads of one RL step (what router replay hands the planner ahead of the step)."""
    loads = np.zeros((case.micro, 1, case.experts), dtype=np.int64)
    for m, ranks in enumerate(step):
        ids = torch.cat([d["ids"] for d in ranks]).reshape(-1)
        loads[m, 0] = torch.bincount(ids[ids >= 0], minlength=case.experts).numpy()
    return loads


def reference(case: Case) -> Dict[str, Any]:
    """The same training in one process, without replication: per micro-step outputs and input gradients of
    every rank's tokens, accumulated weight gradients, and the weights after every optimizer step."""
    data = make_data(case)
    experts = make_experts(case)
    opt = make_optimizer(experts.parameters())
    rec: Dict[str, Any] = {"out": [], "x_grad": [], "w_grad": [], "grads": [], "params": []}
    for step in data:
        for ranks in step:
            x = torch.cat([d["x"] for d in ranks]).requires_grad_(True)
            logits = torch.cat([d["logits"] for d in ranks]).requires_grad_(True)
            w = torch.softmax(logits, dim=-1)
            ids = torch.cat([d["ids"] for d in ranks])
            out = experts(x, ids, w)
            (out * torch.cat([d["target"] for d in ranks])).sum().backward()
            sizes = [d["x"].shape[0] for d in ranks]
            rec["out"].append(out.detach().split(sizes))
            rec["x_grad"].append(x.grad.split(sizes))
            rec["w_grad"].append(logits.grad.split(sizes))
            rec["grads"].append({n: p.grad.clone() for n, p in experts.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
        rec["params"].append({n: p.detach().clone() for n, p in experts.named_parameters()})
    return rec


def close(got: torch.Tensor, want: torch.Tensor, dtype: str, what: str) -> None:
    """``got`` equals ``want`` within 1e-12 (float64) or 1e-5 (float32) of ``want``'s largest magnitude."""
    tol = 1e-12 if dtype == "float64" else 1e-5
    scale = float(want.abs().max()) if want.numel() else 0.0
    err = float((got - want).abs().max()) if want.numel() else 0.0
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert err <= tol * max(scale, 1e-30), f"{what}: max abs error {err:.3e} vs max |ref| {scale:.3e} (tol {tol})"


def assert_equals_reference(case: Case, ranks: List[Dict[str, Any]], ref: Dict[str, Any], held: bool = False) -> None:
    """Every rank's record of a balanced run equals :func:`reference`: outputs, input and routing gradients and
    accumulated owner gradients of every micro-step (``held``: of the last micro-step of each step, where the held
    replica gradients have been flushed), and the owner weights after every optimizer step."""
    n_micro = case.steps * case.micro
    for r, rec in enumerate(ranks):
        owned = torch.tensor(rec["owned"])
        assert len(rec["out"]) == n_micro
        for i in range(n_micro):
            close(rec["out"][i], ref["out"][i][r], case.dtype, f"rank {r} micro-step {i} output")
            close(rec["x_grad"][i], ref["x_grad"][i][r], case.dtype, f"rank {r} micro-step {i} input grad")
            close(rec["w_grad"][i], ref["w_grad"][i][r], case.dtype, f"rank {r} micro-step {i} routing grad")
            for n in rec["names"] if not held or i % case.micro == case.micro - 1 else ():
                close(rec["grads"][i][n], ref["grads"][i][n][owned], case.dtype,
                      f"rank {r} micro-step {i} accumulated grad of {n}")
        assert len(rec["params"]) == case.steps
        for s in range(case.steps):
            for n in rec["names"]:
                close(rec["params"][s][n], ref["params"][s][n][owned], case.dtype, f"rank {r} step {s} {n}")


def init_group(rank: int, world: int, tmp: str, timeout_s: float = 60.0) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


def train_rank(rank: int, case: Case, tmp: str) -> None:
    """One rank of the balanced run; writes what it saw to ``tmp/rank{rank}.pt``."""
    init_group(rank, case.world, tmp)
    save_and_leave(train(rank, case), tmp, rank)


def train(rank: int, case: Case, opts: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """One rank's balanced run in an initialised group. ``opts``: ``mirror`` (``True`` or ``"node"``),
    ``local_world``, ``verify`` and ``faults`` (the fields of a ``FaultSchedule``) of the layer; ``skip_refresh``
    (optimizer steps after which the mirror is not refreshed: the next call must fail, then it is refreshed and the
    call retried); ``faults_off_on_error`` (a failed call is recorded, then retried and the run continued with the
    fault injector off); ``prefetch``
    (``"after_backward"`` or ``"before_backward"``: where micro-step ``m + 1`` is prefetched, the first one of a
    step after the optimizer step); ``driver`` (plans from a ``ReplayDriver``); ``double_buffer`` (the layer's);
    ``lag`` (pipelined: the backward of micro-step ``m`` runs after the forward of ``m + 1``); ``hold`` (held
    replica gradients: ``gradients="hold"``, the last micro-step of each step ``"flush"``; ``"no_flush"``: never
    flushed, so the first call after an optimizer step must fail)."""
    opts = opts or {}
    data = make_data(case)
    faults = ft.FaultSchedule(**opts["faults"]) if opts.get("faults") else None
    mirror = opts.get("mirror", False)  # False, True (per rank) or "node"
    layer = ft.BalancedMoE(make_experts(case), case.slots, timeout=opts.get("timeout", 60.0), mirror=mirror,
                           verify=opts.get("verify", True), faults=faults,
                           double_buffer=bool(opts.get("double_buffer")), local_world=opts.get("local_world"))
    if opts.get("room"):  # the gradient engine may use only this many rows per rank: returns split into reductions
        layer.storage._reducer = ft.mover.GradReducer(layer.storage, None, 60.0)
        layer.storage._reducer.room[:] = opts["room"]
    opt = make_optimizer(layer.parameters())
    planner = foremoe.Planner(foremoe.Topology(case.nodes, case.world // case.nodes, case.slots))
    rec: Dict[str, Any] = {"out": [], "x_grad": [], "w_grad": [], "grads": [], "params": [], "sync": [],
                           "owned": layer.storage.owned_experts, "names": list(layer.storage.names),
                           "param_names": [n for n, _ in layer.named_parameters()], "replica_tokens": 0,
                           "state_dict": list(layer.state_dict()), "errors": [], "max_row": -1, "held": []}
    ahead = opts.get("prefetch")  # None, "after_backward" or "before_backward": when micro-step m + 1 is prefetched
    for s, step in enumerate(data):
        driver = ft.ReplayDriver(planner, step_loads(case, step), owners=layer.owners) if opts.get("driver") else None
        plans = list(driver) if driver else planner.plan(step_loads(case, step), owners=layer.owners)
        plan_of = [None if (s, m) in case.plain else plans[m] for m in range(case.micro)]

        def prefetch(m: int) -> None:
            if driver:
                assert driver.prefetch(m, [layer]) is plan_of[m]
            else:
                layer.prefetch(plan_of[m])

        lagging: List[Tuple[torch.Tensor, ...]] = []  # forwards whose backward has not run yet
        if ahead and plan_of[0] is not None:
            prefetch(0)  # after the optimizer step and the mirror refresh: the owners are final
        for m, ranks in enumerate(step):
            d = ranks[rank]
            x = d["x"].clone().requires_grad_(True)
            logits = d["logits"].clone().requires_grad_(True)
            plan = plan_of[m]
            hold = opts.get("hold")
            gradients = "reduce" if not hold else "flush" if m + 1 == case.micro and hold != "no_flush" else "hold"
            start = time.monotonic()
            try:
                out = layer(x, d["ids"], torch.softmax(logits, dim=-1), plan, gradients=gradients)
            except RuntimeError as e:
                rec["errors"].append({"step": s, "micro": m, "message": str(e), "seconds": time.monotonic() - start})
                if opts.get("faults_off_on_error"):
                    layer.storage.faults = None
                elif s - 1 in opts.get("skip_refresh", ()):
                    layer.refresh_mirror()
                else:
                    raise
                out = layer(x, d["ids"], torch.softmax(logits, dim=-1), plan, gradients=gradients)
            rec["sync"].append(asdict(layer.last_sync))
            rec["held"].append(sorted(layer.storage._held))  # (holder, expert) of the gradients held now
            rec["max_row"] = max([rec["max_row"], *layer.storage.replica_experts().values()])
            nxt = plan_of[m + 1] if ahead and m + 1 < case.micro else None
            if nxt is not None and ahead == "before_backward":
                prefetch(m + 1)  # staged: this micro-step's replica rows stay untouched until the next call
            lagging.append((out, d["target"], x, logits))
            keep = 1 if opts.get("lag") and m + 1 < case.micro else 0
            while len(lagging) > keep:
                backward_and_record(rec, layer, *lagging.pop(0))
            if nxt is not None and ahead == "after_backward":
                prefetch(m + 1)
            if plan is not None:
                taken, place = np.asarray(plan.slot_tokens[0]), np.asarray(plan.gpu_slots[0])
                rec["replica_tokens"] += int(sum(taken[g, j] for g in range(case.world) for j in range(case.slots)
                                                 if place[g, j] >= 0 and layer.owners[place[g, j]] != g))
        if driver:
            driver.close()
        optimizer_step(rec, opt, layer)
        if mirror and s not in opts.get("skip_refresh", ()):
            layer.refresh_mirror()
        if opts.get("close"):  # the storage's engine ends; the next sync with moves makes a new one
            layer.storage.close()
            assert layer.storage._mover is None
    mover = layer.storage._mover
    rec["mover"] = layer.storage.engine_backend
    rec["engine_batches"] = 0 if mover is None else int(mover.engine.stats()["batches"])
    rec["engine_reductions"] = layer.storage.engine_reductions  # replica gradient reductions run on the engine
    rec["reduction_retries"] = layer.storage.reduction_retries
    return rec


def backward_and_record(rec: Dict[str, Any], layer: ft.BalancedMoE, out: torch.Tensor, target: torch.Tensor,
                        x: torch.Tensor, logits: torch.Tensor) -> None:
    (out * target).sum().backward()
    record_micro_step(rec, layer, out, x, logits)


def fault_rank(rank: int, case: Case, runs: List[Dict[str, Any]], tmp: str) -> None:
    """Runs ``train(rank, case, opts)`` for every ``opts`` of ``runs`` in one group; also checks that a mirror
    gathered from the owners over the group equals the full weights. Writes ``{"runs": [...], "gathered": bool}``."""
    init_group(rank, case.world, tmp)
    full = {n: getattr(make_experts(case), n).detach() for n in ft.SwiGLUExperts.weight_names}
    owners = ft.contiguous_owners(case.experts, case.world)
    mine = {n: w[torch.from_numpy(np.flatnonzero(owners == rank))] for n, w in full.items()}
    st = ft.ExpertStorage(mine, owners, case.slots, rank=rank, world=case.world, mirror=True)
    gathered = all(torch.equal(st.mirror.tensors[n], w) for n, w in full.items())
    save_and_leave({"runs": [train(rank, case, o) for o in runs], "gathered": gathered}, tmp, rank)


def corrupt_reductions_rank(rank: int, case: Case, opts: Dict[str, Any], tmp: str) -> None:
    """``train(rank, case, opts)`` with the engine's fault injector acting on the replica-gradient reductions too
    (TEST ONLY: foremoe.torch keeps it off them, ``foremoe.torch.mover._sparing``)."""
    from foremoe.torch import mover

    mover._sparing = lambda faults: faults
    init_group(rank, case.world, tmp)
    save_and_leave(train(rank, case, opts), tmp, rank)


def record_micro_step(rec: Dict[str, Any], layer: ft.BalancedMoE, out: torch.Tensor, x: torch.Tensor,
                      logits: torch.Tensor) -> None:
    """What the equivalence tests compare after a micro-step's backward: output, input and routing gradients and
    the owner weights' accumulated gradients."""
    rec["out"].append(out.detach())
    rec["x_grad"].append(x.grad)
    rec["w_grad"].append(logits.grad)
    rec["grads"].append({n: p.grad.clone() for n, p in layer.storage.params.items()})


def optimizer_step(rec: Dict[str, Any], opt: torch.optim.Optimizer, layer: ft.BalancedMoE) -> None:
    """One optimizer step; records the owner weights after it."""
    opt.step()
    opt.zero_grad(set_to_none=True)
    rec["params"].append({n: p.detach().clone() for n, p in layer.storage.params.items()})


def save_and_leave(rec: Dict[str, Any], tmp: str, rank: int) -> None:
    """Writes what the rank saw to ``tmp/rank{rank}.pt`` and leaves the group."""
    torch.save(rec, f"{tmp}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def _entry(rank: int, fn: Callable[..., None], args: tuple, tmp: str) -> None:
    try:
        fn(rank, *args)
    except BaseException:
        Path(f"{tmp}/error{rank}.txt").write_text(traceback.format_exc())
        raise


_PRELOADED = False


def _start_method() -> str:
    """How ranks start: "forkserver" by default, with torch, foremoe.torch, the adapters and this module imported
    once in the server, so that a rank is a fork of an interpreter that has them (with "spawn" every rank imported
    torch 2.x, about 4 s, and Megatron-core, about 7 s more, wall time on the shared machine);
    FOREMOE_TEST_START_METHOD=spawn for the old way. The server has no process group, no threads of torch's pools
    and no CUDA context when it forks (it only imports), so each rank starts clean."""
    global _PRELOADED
    method = os.environ.get("FOREMOE_TEST_START_METHOD", "forkserver")
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"FOREMOE_TEST_START_METHOD must be forkserver or spawn, got {method!r}")
    if method == "forkserver" and not _PRELOADED:
        import multiprocessing

        # The adapters import Megatron-core and transformers (about 3 s and 1 s of CPU per rank); where those are
        # not installed their import fails and the server goes on without them (multiprocessing skips a preload
        # module that raises ImportError).
        multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "foremoe.torch", "foremoe.megatron",
                                                "foremoe.transformers", __name__])
        _PRELOADED = True
    return method


def run_ranks(fn: Callable[..., None], world: int, args: tuple, tmp: str, timeout: float = 240.0) -> None:
    """Runs ``fn(rank, *args)`` in ``world`` spawned processes; raises with a rank's traceback when one fails
    and kills them all when they take longer than ``timeout`` seconds."""
    os.makedirs(tmp, exist_ok=True)
    ctx = mp.start_processes(_entry, args=(fn, args, tmp), nprocs=world, join=False, start_method=_start_method())
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks did not finish within {timeout:g} s")
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        errs = sorted(Path(tmp).glob("error*.txt"))
        raise RuntimeError("a rank failed:\n" + "\n".join(p.read_text() for p in errs)) from e
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()


def _catch(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except (ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def two_rank_layer(rank: int, tmp: str, seed: int) -> Tuple[Case, Any, ft.SwiGLUExperts, Dict[str, torch.Tensor],
                                                              ft.BalancedMoE]:
    """A 2-rank group, one RL step of 2 micro-steps of data, the experts, their full weights and the balanced layer
    (what the error tests of one layer start from)."""
    case = Case(world=2, experts=16, topk=2, hidden=32, ffn=32, steps=1, micro=2, dtype="float64", seed=seed)
    init_group(rank, 2, tmp)
    experts = make_experts(case)
    full = {n: getattr(experts, n).detach().clone() for n in experts.weight_names}
    return case, make_data(case)[0], experts, full, ft.BalancedMoE(experts, case.slots, timeout=30.0)


def reduction_failure_rank(rank: int, tmp: str) -> None:
    """Micro-steps of a 2-rank layer (5 s deadlines) whose last backward's replica gradient reduction is refused on
    rank 1 alone (its gradient engine is handed owners that make a returning replica an owner copy); writes
    ``{micro-step: backward's error or "no error"}`` and the reductions before the last to ``tmp/rank{rank}.pt`` and
    leaves without a barrier (the group may be broken)."""
    case = Case(world=2, experts=16, topk=2, hidden=32, ffn=32, dtype="float64", seed=31, spare=2, steps=1, micro=3)
    init_group(rank, 2, tmp)
    data = make_data(case)[0]
    layer = ft.BalancedMoE(make_experts(case), case.slots, timeout=5.0)
    plans = foremoe.Planner(foremoe.Topology(1, 2, case.slots)).plan(step_loads(case, data), owners=layer.owners)
    def returns(plan: Any) -> int:  # replicas given tokens: gradients that return in the backward
        place, taken = np.asarray(plan.gpu_slots[0]), np.asarray(plan.slot_tokens[0])
        return int(((layer.owners[place] != np.arange(2)[:, None]) & (place >= 0) & (taken > 0)).sum())

    last = [m for m in range(case.micro) if returns(plans[m])][-1]
    out: Dict[Any, Any] = {"last": last}
    for m in range(last + 1):
        d = data[m][rank]
        x = d["x"].clone().requires_grad_(True)
        y = layer(x, d["ids"], torch.softmax(d["logits"], dim=-1), plans[m])
        if m == last:
            out["reductions"] = layer.storage.engine_reductions
            if rank == 1:
                red = layer.storage._reducer
                red.owner_gpu = (1 - red.owner_gpu).astype(np.int32)  # every returning replica an "owner"
        out[m] = _catch(lambda: ((y - d["target"]) ** 2).sum().backward())
    torch.save(out, f"{tmp}/rank{rank}.pt")


def bad_input_rank(rank: int, tmp: str) -> None:
    """Runs each bad input of the error test on both ranks of a 2-rank group, then a good call (the group is
    still usable after every error); writes ``{case: message}`` to ``tmp/rank{rank}.pt``."""
    case, data, experts, full, layer = two_rank_layer(rank, tmp, seed=7)
    topo = foremoe.Topology(1, 2, case.slots)
    loads = step_loads(case, data)
    plans = foremoe.Planner(topo).plan(loads, owners=layer.owners)
    d = data[0][rank]
    w = torch.softmax(d["logits"], dim=-1)
    out: Dict[str, str] = {}

    def call(x=d["x"], ids=d["ids"], weights=w, plan=plans[0], module=layer):
        return module(x, ids, weights, plan)

    bad = d["ids"].clone()
    bad[3, 1] = 99
    out["id_out_of_range"] = _catch(lambda: call(ids=bad if rank == 1 else d["ids"]))
    out["weights_shape"] = _catch(lambda: call(weights=torch.ones(w.shape[0], 3, dtype=w.dtype) if rank == 0 else w))
    out["x_tokens"] = _catch(lambda: call(x=torch.cat([d["x"], d["x"][:1]]) if rank == 1 else d["x"]))
    out["hidden"] = _catch(lambda: call(x=d["x"][:, :31] if rank == 0 else d["x"]))
    out["plan_other_micro_step"] = _catch(lambda: call(plan=plans[1]))
    # A two-layer plan whose layer 1 has other loads: the module of layer 1 fed layer 0's routing.
    two = np.concatenate([loads[:1], loads[1:2]], axis=1)  # [1, 2, E]
    plan2 = foremoe.Planner(topo).plan(two, owners=np.stack([layer.owners] * 2))[0]
    layer1 = ft.BalancedMoE(make_experts(case), case.slots, layer=1, timeout=30.0)
    out["plan_other_layer"] = _catch(lambda: call(plan=plan2, module=layer1))
    layer3 = ft.BalancedMoE(make_experts(case), case.slots, layer=3, timeout=30.0)
    out["layer_out_of_range"] = _catch(lambda: call(plan=plan2, module=layer3))
    rotated = (layer.owners + 1) % 2
    out["plan_other_owners"] = _catch(lambda: call(plan=foremoe.Planner(topo).plan(loads[0], owners=rotated)))
    sub = dist.new_group([0])
    if rank == 0:
        out["group_wrong_size"] = _catch(lambda: ft.balanced_moe(d["x"], d["ids"], w, plans[0], layer.storage,
                                                                 layer.expert_fn, group=sub))
        small = ft.BalancedMoE(make_experts(case), case.experts, group=sub, timeout=30.0)  # one rank owns them all
        out["plan_for_other_group"] = _catch(lambda: call(module=small))
    # Still usable: a good call equals the single-process layer on this rank's tokens.
    got = call()
    want = ft.reference_moe(d["x"], d["ids"], w, full, experts.expert)
    out["good_after_errors"] = "equal" if torch.allclose(got, want, rtol=1e-12, atol=1e-12) else "differs"
    save_and_leave(out, tmp, rank)


def timeout_rank(rank: int, tmp: str) -> None:
    """Rank 1 never calls the layer: rank 0's call must fail within its timeout instead of hanging."""
    case = Case(world=2, experts=16, topk=2, hidden=32, ffn=32, steps=1, micro=1, seed=8)
    init_group(rank, 2, tmp)
    data = make_data(case)[0]
    layer = ft.BalancedMoE(make_experts(case), case.slots, timeout=1.5)
    plan = foremoe.Planner(foremoe.Topology(1, 2, case.slots)).plan(step_loads(case, data)[0], owners=layer.owners)
    dist.barrier()
    if rank == 0:
        d = data[0][0]
        start = time.monotonic()
        msg = _catch(lambda: layer(d["x"], d["ids"], torch.softmax(d["logits"], dim=-1), plan))
        torch.save({"message": msg, "seconds": time.monotonic() - start}, f"{tmp}/rank0.pt")
    else:
        time.sleep(4.0)
    os._exit(0)  # the group holds rank 0's abandoned collective: leave without tearing it down


def runs_rank(rank: int, case: Case, runs: List[Dict[str, Any]], tmp: str) -> None:
    """Runs ``train(rank, case, opts)`` for every ``opts`` of ``runs`` in one group; writes ``{"runs": [...]}``."""
    init_group(rank, case.world, tmp)
    save_and_leave({"runs": [train(rank, case, o) for o in runs]}, tmp, rank)


def prefetch_misuse_rank(rank: int, tmp: str) -> None:
    """Each prefetch misuse on both ranks of a 2-rank group, each followed by a good call that must equal the
    single-process layer; writes ``{case: message}`` to ``tmp/rank{rank}.pt``."""
    case, data, experts, full, layer = two_rank_layer(rank, tmp, seed=9)
    plans = foremoe.Planner(foremoe.Topology(1, 2, case.slots)).plan(step_loads(case, data), owners=layer.owners)
    out: Dict[str, str] = {}

    def call(m: int = 0, plan: Any = "same") -> torch.Tensor:
        d = data[m][rank]
        return layer(d["x"], d["ids"], torch.softmax(d["logits"], dim=-1), plans[m] if plan == "same" else plan)

    def good(m: int) -> str:
        d = data[m][rank]
        want = ft.reference_moe(d["x"], d["ids"], torch.softmax(d["logits"], dim=-1), full, experts.expert)
        return "equal" if torch.allclose(call(m), want, rtol=1e-12, atol=1e-12) else "differs"

    call(0)  # micro-step 0's replicas resident
    layer.prefetch(plans[1])
    out["other_plan"] = _catch(lambda: call(0))
    out["after_other_plan"] = good(0)
    layer.prefetch(plans[1])
    out["twice"] = _catch(lambda: layer.prefetch(plans[1]))
    out["after_twice"] = good(1)
    layer.prefetch(plans[0])
    with torch.no_grad():
        for p in layer.storage.params.values():
            p.mul_(1.0)  # an in-place update between prefetch and call (same values, new version)
    out["owners_changed"] = _catch(lambda: call(0))
    out["after_owners_changed"] = good(0)
    layer.prefetch(plans[1])
    out["plain_call"] = _catch(lambda: call(1, plan=None))
    out["after_plain_call"] = good(1)
    layer.storage.invalidate()  # every replica of plan 0 is re-sent, so there is something to prefetch
    layer.prefetch(plans[0])
    out["prefetched"] = str(layer.last_sync.prefetched if call(0) is not None else -1)
    out["stats"] = str(asdict(layer.last_sync))
    save_and_leave(out, tmp, rank)


def shared_engine_rank(rank: int, tmp: str) -> None:
    """The storages of a model share one transfer engine per rank (foremoe.torch.mover, "One engine for the
    layers"): three storages of one kind sync moves on one engine, each on its own engine layers, every replica row
    holding its expert's weights; a storage with a fault injector, one constructed after the engine was made and
    one that closed and syncs again get engines of their own; the shared engine closes with its last storage.
    Records what it saw for the test to check."""
    import gc

    from foremoe.torch import mover as M

    init_group(rank, 2, tmp)
    E, G, S = 8, 2, 6
    own = np.repeat(np.arange(G), E // G).astype(np.int32)
    gen = torch.Generator().manual_seed(5)
    full = [{"w1": torch.randn(E, 4, 3, generator=gen, dtype=torch.float64),
             "w2": torch.randn(E, 3, 4, generator=gen, dtype=torch.float64)} for _ in range(5)]
    planner = foremoe.Planner(foremoe.Topology(1, G, S))
    loads = np.array([[400, 300, 10, 10, 200, 10, 10, 10]], dtype=np.int64)  # rank 0's experts hot: replicas move
    plan = planner.plan(loads, owners=own)

    def make(i, **opts):
        return ft.ExpertStorage.from_full(full[i], own, S, rank=rank, world=G, **opts)

    def check_rows(st, i):
        for e, row in st.replica_experts().items():
            for n in ("w1", "w2"):
                assert torch.equal(st.storage[n][row], full[i][n][e]), (i, e, n)
        return len(st.replica_experts())

    rec: Dict[str, Any] = {}
    stores = [make(0), make(1), make(2), make(3, verify=True)]
    stores[3].faults = ft.FaultSchedule(seed=3)  # a fault injector: an engine of its own
    for i, st in enumerate(stores):
        st.sync(plan, 0, [], timeout=30.0)
    rec["replicas"] = [check_rows(st, i) for i, st in enumerate(stores)]
    movers = [st._mover for st in stores]
    rec["shared"] = [m.shared for m in movers]
    rec["layers"] = [m.layer for m in movers]
    rec["same_engine"] = movers[0].engine is movers[1].engine is movers[2].engine
    rec["own_engine"] = movers[3].engine is not movers[0].engine
    rec["engines"] = M.shared_engines()
    late = make(4)  # constructed after the engine of its range was made
    late.sync(plan, 0, [], timeout=30.0)
    rec["late"] = (late._mover.shared, late._mover.engine is not movers[0].engine, check_rows(late, 4))
    rec["engines_late"] = M.shared_engines()
    stores[1].close()
    stores[1].resident_rows.fill(-1)  # forget the replicas: the next sync moves them again
    stores[1].sync(plan, 0, [], timeout=30.0)  # after its close: an engine of its own
    rec["reopened"] = (stores[1]._mover.shared, check_rows(stores[1], 1))
    for st in stores[:3]:
        st.close()
    rec["after_close"] = M.shared_engines()
    del stores, movers, st
    gc.collect()
    rec["after_collect"] = M.shared_engines()
    late.close()
    rec["after_all"] = M.shared_engines()
    torch.save(rec, f"{tmp}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
