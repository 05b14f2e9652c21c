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
from typing import Any, Callable, Dict, List

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


def init_group(rank: int, world: int, tmp: str, timeout_s: float = 60.0) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


def train_rank(rank: int, case: Case, tmp: str) -> None:
    """One rank of the balanced run; writes what it saw to ``tmp/rank{rank}.pt``."""
    init_group(rank, case.world, tmp)
    data = make_data(case)
    layer = ft.BalancedMoE(make_experts(case), case.slots, timeout=60.0)
    opt = make_optimizer(layer.parameters())
    planner = foremoe.Planner(foremoe.Topology(case.nodes, case.world // case.nodes, case.slots))
    rec: Dict[str, Any] = {"out": [], "x_grad": [], "w_grad": [], "grads": [], "params": [], "sync": [],
                           "owned": layer.storage.owned_experts, "names": list(layer.storage.names),
                           "param_names": [n for n, _ in layer.named_parameters()], "replica_tokens": 0}
    for step in data:
        plans = planner.plan(step_loads(case, step), owners=layer.owners)
        for m, ranks in enumerate(step):
            d = ranks[rank]
            x = d["x"].clone().requires_grad_(True)
            logits = d["logits"].clone().requires_grad_(True)
            out = layer(x, d["ids"], torch.softmax(logits, dim=-1), plans[m])
            (out * d["target"]).sum().backward()
            rec["out"].append(out.detach())
            rec["x_grad"].append(x.grad)
            rec["w_grad"].append(logits.grad)
            rec["grads"].append({n: p.grad.clone() for n, p in layer.storage.params.items()})
            rec["sync"].append(asdict(layer.last_sync))
            taken = np.asarray(plans[m].slot_tokens[0])
            place = np.asarray(plans[m].gpu_slots[0])
            rec["replica_tokens"] += int(sum(taken[g, j] for g in range(case.world) for j in range(case.slots)
                                             if place[g, j] >= 0 and layer.owners[place[g, j]] != g))
        opt.step()
        opt.zero_grad(set_to_none=True)
        rec["params"].append({n: p.detach().clone() for n, p in layer.storage.params.items()})
    torch.save(rec, f"{tmp}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def _entry(rank: int, fn: Callable[..., None], args: tuple, tmp: str) -> None:
    try:
        fn(rank, *args)
    except BaseException:
        Path(f"{tmp}/error{rank}.txt").write_text(traceback.format_exc())
        raise


def run_ranks(fn: Callable[..., None], world: int, args: tuple, tmp: str, timeout: float = 240.0) -> None:
    """Runs ``fn(rank, *args)`` in ``world`` spawned processes; raises with a rank's traceback when one fails
    and kills them all when they take longer than ``timeout`` seconds."""
    os.makedirs(tmp, exist_ok=True)
    ctx = mp.start_processes(_entry, args=(fn, args, tmp), nprocs=world, join=False, start_method="spawn")
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
