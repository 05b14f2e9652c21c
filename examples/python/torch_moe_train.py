"""A small MoE model trained on the CPU by 4 processes over gloo, with ForeMoE and without it.

Each RL step: a "rollout" forward (plain expert parallelism, no grad) records every token's top-k experts per
layer. Router replay then hands those ids to a ``foremoe.torch.ReplayDriver``, which counts the loads of every
micro-step and layer, sums them over the ranks and plans every micro-step of the step in a background thread
while the passes run. The recompute pass (forward only, as for the old policy's log-probs) and the update pass
(forward + backward with gradient accumulation, one optimizer step) replay the recorded experts (routing weights
recomputed by the current router) under the same plan per micro-step. The same training runs a second time
without ForeMoE (plain expert parallelism, ``plan=None``): the losses match, and per micro-step the example prints
the slowest rank's share of the expert work (max / mean tokens per rank) without and with ForeMoE and the bytes of
replica weights moved (at the recompute pass, where each layer's moves are prefetched while the layer before it
computes; the update pass reuses them).

Run: python examples/python/torch_moe_train.py     (needs torch with gloo; about 10 s)
"""

from __future__ import annotations

import datetime
import os
import sys
import tempfile

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import foremoe
import foremoe.torch as ft

WORLD, EXPERTS, TOPK, HIDDEN, FFN, LAYERS = 4, 32, 2, 32, 48, 2
SLOTS = EXPERTS // WORLD + 3  # owned experts + 3 spare replica slots per rank and layer
STEPS, MICRO, TOKENS = 3, 4, 96  # RL steps, micro-steps per step, tokens per rank and micro-step
DTYPE = torch.float64


class Block(torch.nn.Module):
    """Router + MoE layer with a residual connection."""

    def __init__(self, layer: int, g: torch.Generator):
        super().__init__()
        self.router = torch.nn.Linear(HIDDEN, EXPERTS, bias=False, dtype=DTYPE)
        with torch.no_grad():
            self.router.weight.copy_(torch.randn(EXPERTS, HIDDEN, generator=g, dtype=DTYPE) / HIDDEN ** 0.5)
        experts = ft.SwiGLUExperts(EXPERTS, HIDDEN, FFN, dtype=DTYPE, generator=g)
        self.moe = ft.BalancedMoE(experts, SLOTS, layer=layer)

    def forward(self, x, ids=None, plan=None):
        probs = torch.softmax(self.router(x), dim=-1)
        if ids is None:  # the rollout's own routing
            ids = probs.topk(TOPK, dim=-1).indices
        w = probs.gather(1, ids)
        w = w / w.sum(dim=-1, keepdim=True)
        return x + self.moe(x, ids, w, plan), ids


class Model(torch.nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.blocks = torch.nn.ModuleList(Block(l, g) for l in range(LAYERS))

    def forward(self, x, ids=None, plans=None, prefetch=None):
        routed = []
        for l, b in enumerate(self.blocks):
            if prefetch is not None and l + 1 < len(self.blocks):
                prefetch(l + 1)  # the next layer's replica moves are in flight while this layer computes
            x, i = b(x, None if ids is None else ids[:, l], None if plans is None else plans)
            routed.append(i)
        return x, torch.stack(routed, dim=1)  # [T, L, K]


def batch(step: int, micro: int, rank: int):
    """Tokens of one micro-batch: a few "sequences" whose tokens sit near a common direction, so they route
    coherently (the skew that makes micro-step loads swing)."""
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    centers = torch.randn(2, HIDDEN, generator=g, dtype=DTYPE) * 1.5
    which = torch.randint(0, 2, (TOKENS,), generator=g)
    x = centers[which] + torch.randn(TOKENS, HIDDEN, generator=g, dtype=DTYPE)
    return x, 0.5 * torch.randn(TOKENS, HIDDEN, generator=g, dtype=DTYPE)


def gpu_load_ratio(loads_le: np.ndarray, owners: np.ndarray) -> float:
    """Mean over layers of max/mean tokens per rank under plain expert parallelism."""
    r = []
    for le in loads_le:
        per = np.bincount(owners, weights=le, minlength=WORLD)
        r.append(per.max() / per.mean())
    return float(np.mean(r))


def train(rank: int, use_foremoe: bool, log: list) -> list:
    model = Model(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    planner = foremoe.Planner(foremoe.Topology(2, WORLD // 2, SLOTS))
    owners = model.blocks[0].moe.owners
    losses = []
    resident = None
    prefetched = [0]  # replica moves posted ahead, all ranks
    for step in range(STEPS):
        # Rollout: forward without grad, plain expert parallelism; record the routing.
        with torch.no_grad():
            routed = [model(batch(step, m, rank)[0])[1] for m in range(MICRO)]
        driver = None
        if use_foremoe:
            # Router replay: this rank's recorded ids [T, L, K] of the step with the micro-batch boundaries; the
            # driver sums the loads over the ranks and plans every micro-step ahead, in a background thread.
            driver = ft.ReplayDriver.from_ids(planner, torch.cat(routed), np.arange(MICRO + 1) * TOKENS,
                                              num_experts=EXPERTS, owners=owners, resident=resident,
                                              num_layers=LAYERS, group=dist.group.WORLD)
            loads = driver.loads  # [M, L, E], known before the stage runs

        def plan(m):
            return driver.plan(m) if driver is not None else None  # one plan object per micro-step

        # Recompute: forward only, every micro-step under its plan (this is where the replicas move in). Layer
        # l + 1's moves are prefetched when layer l starts (ReplayDriver.prefetch: staged, installed at its call).
        recomputed, moved = [], []
        with torch.no_grad():
            for m in range(MICRO):
                ahead = (lambda l, m=m: driver.prefetch(m, [model.blocks[l].moe])) if use_foremoe else None
                recomputed.append(model(batch(step, m, rank)[0], ids=routed[m], plans=plan(m), prefetch=ahead)[0])
                moved.append(sum(b.moe.last_sync.bytes_moved for b in model.blocks) if use_foremoe else 0)
                if use_foremoe:  # every move of layer 1 was posted ahead, while layer 0 computed
                    last = model.blocks[1].moe.last_sync
                    if last.prefetched != last.moves:
                        sys.exit(f"step {step} micro-step {m}: {last.prefetched} of layer 1's {last.moves} moves "
                                 f"were prefetched")
                    prefetched[0] += last.prefetched
        # Update: the same micro-steps with gradients, under the same plans (resident replicas reused).
        for m in range(MICRO):
            x, target = batch(step, m, rank)
            out, _ = model(x, ids=routed[m], plans=plan(m))
            if not torch.equal(out.detach(), recomputed[m]):
                sys.exit(f"step {step} micro-step {m}: the update forward differs from the recompute forward")
            loss = ((out - target) ** 2).mean() / MICRO
            loss.backward()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(float(total) / WORLD * MICRO)  # the micro-batch mean squared error
            if use_foremoe:
                after = float(np.mean(plan(m).max_gpu_load / (loads[m].sum(axis=1) / WORLD)))
                log.append((step, m, gpu_load_ratio(loads[m], owners), after, moved[m], losses[-1]))
        if driver is not None:
            resident = driver.last_plan  # the next step starts from this placement
            driver.close()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if use_foremoe:
        log.append(prefetched[0])
    return losses


def worker(rank: int, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    log: list = []
    with_fm = train(rank, True, log)
    without = train(rank, False, [])
    if rank == 0:
        print("step micro  max/mean tokens per rank: plain EP -> ForeMoE   moved      loss (ForeMoE)   loss (plain)")
        prefetched = log.pop()
        for (s, m, before, after, moved, loss), plain in zip(log, without):
            print(f"{s:4d} {m:5d}  {before:30.3f} -> {after:7.3f}   {moved / 1e3:7.1f} kB  {loss:14.10f}  {plain:14.10f}")
        diff = max(abs(a - b) / abs(b) for a, b in zip(with_fm, without))
        print(f"replica moves of layer 1 prefetched while layer 0 computed: {prefetched}")
        print(f"largest relative loss difference with and without ForeMoE: {diff:.1e}")
        if diff > 1e-10:
            sys.exit(f"losses differ by {diff:.1e}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(worker, args=(tmp,), nprocs=WORLD, start_method="spawn")
    print("done")
