"""A tiny Qwen3-MoE model from transformers 5.23, trained RL-style on the CPU by 4 processes over gloo, with ForeMoE and
without it.

The model is loaded with ``DistributedConfig(tp_size=4, ep_size=4, ep_implementation=...)``: the 4 ranks share each
batch (tensor parallelism of the dense modules), each dispatches its slice of the tokens, and each owns 16 / 4 = 4
experts per MoE layer. ``import foremoe.transformers`` registers ``ep_implementation="foremoe"``;
``foremoe.transformers.ForeMoE(model, spare_slots=2)`` turns each rank's experts into the owner rows of an
``ExpertStorage`` with 2 spare rows for replicas of other ranks' hot experts.

Each RL step:

1. rollout: a forward without gradients records every MoE router's top-k ids (``moe.record()``);
2. a ``ReplayDriver`` counts the loads of every micro-step and MoE layer from those ids and plans each micro-step in
   a background thread (``moe.replay_driver``);
3. recompute (forward only, the old policy's log-probs) and update (forward + backward, gradients accumulated over
   the micro-steps, one optimizer step) run every micro-step inside ``moe.micro_step(plan, ids)``: the routers replay
   the recorded ids (routing weights recomputed from the current router logits) and every MoE layer dispatches its
   tokens to owners and replicas as the plan splits them.

The same training runs again with transformers' own ``ep_implementation="all_to_all"`` and the same routing replay
(``foremoe.transformers.RoutingReplay``): the losses are equal, and per micro-step the example prints the busiest
rank's share of the expert work (max / mean (token, expert) pairs per rank, mean over the MoE layers) without and
with ForeMoE.

Run: python examples/python/transformers_train.py   (torch >= 2.7, transformers 5.23; about a minute on 2 cores)
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
import torch.nn.functional as F

import foremoe

WORLD, EXPERTS, TOPK, LAYERS, SPARE = 4, 16, 2, 2, 2
STEPS, MICRO, BATCH, SEQ, VOCAB = 2, 3, 2, 16, 128
DTYPE = torch.float64


def save_tiny_model(path: str) -> None:
    """A random tiny Qwen3-MoE (no hub access needed), with sharp routers so that routing is skewed."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=LAYERS, num_attention_heads=WORLD, num_key_value_heads=WORLD,
                            head_dim=8, num_experts=EXPERTS, num_experts_per_tok=TOPK, norm_topk_prob=True)
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 1.0)
    model.save_pretrained(path)


def micro_batches(step: int) -> list:
    """The step's micro-batches (the same on every rank: the ranks share the batch). Each draws from a few token
    kinds of its own, so each micro-step has its own hot experts."""
    g = torch.Generator().manual_seed(step)
    out = []
    for _ in range(MICRO):
        kinds = torch.randperm(VOCAB, generator=g)[:4]
        out.append(kinds[torch.randint(0, 4, (BATCH, SEQ), generator=g)])
    return out


def train(path: str, impl: str, log: list) -> list:
    import foremoe.transformers as fmt  # registers ep_implementation="foremoe"
    from transformers import Qwen3MoeForCausalLM
    from transformers.distributed import DistributedConfig

    dist_config = DistributedConfig(tp_size=WORLD, ep_size=WORLD, ep_implementation=impl)
    model = Qwen3MoeForCausalLM.from_pretrained(path, distributed_config=dist_config, dtype=DTYPE,
                                                experts_implementation="eager")
    if impl == "foremoe":
        moe = fmt.ForeMoE(model, spare_slots=SPARE)  # once, on every rank, after loading
        routing = moe.routing
        planner = foremoe.Planner(moe.topology())
    else:
        moe, routing = None, fmt.RoutingReplay(model)  # the same replay, transformers' own dispatch
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, foreach=False)
    losses, resident = [], None
    for step in range(STEPS):
        batches = micro_batches(step)
        with torch.no_grad(), routing.record() as rollout:  # 1. rollout: record the routing
            for mb in batches:
                model(input_ids=mb)
        ids = [rollout.ids(m) for m in range(MICRO)]  # [tokens, layers, top-k] per micro-batch
        driver = None
        if moe is not None:  # 2. one plan per micro-step, planned ahead in a background thread
            driver = moe.replay_driver(planner, rollout.ids(), rollout.offsets(), resident=resident)

        def micro_step(m: int):
            return moe.micro_step(driver.plan(m), ids[m]) if moe is not None else routing.replay(ids[m])

        with torch.no_grad():  # 3a. recompute: the old policy's logits, replayed routing
            for m, mb in enumerate(batches):
                with micro_step(m):
                    model(input_ids=mb)
        for m, mb in enumerate(batches):  # 3b. update: forward and backward inside the micro-step
            with micro_step(m):
                logits = model(input_ids=mb).logits
                loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), mb[:, 1:].reshape(-1))
                (loss / MICRO).backward()
            losses.append(float(loss.detach()))
            if moe is not None:
                plain = moe.tokens_per_rank(ids[m])  # [layers, ranks] without ForeMoE: every pair on its owner
                balanced = moe.tokens_per_rank(ids[m], driver.plan(m))
                ratio = [float(np.mean([t.max() / t.mean() for t in x])) for x in (plain, balanced)]
                log.append((step, m, *ratio, moe.replica_tokens(driver.plan(m))))
        if driver is not None:
            resident = driver.last_plan  # the next step starts from this placement
            driver.close()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses


def worker(rank: int, tmp: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD))
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=120))
    import transformers

    transformers.logging.set_verbosity_error()  # the tiny model leaves some of its tensor-parallel rules unused
    transformers.logging.disable_progress_bar()
    path = f"{tmp}/model"
    if rank == 0:
        save_tiny_model(path)
    dist.barrier()
    log: list = []
    with_fm = train(path, "foremoe", log)
    without = train(path, "all_to_all", [])
    if rank == 0:
        print("step micro  max/mean pairs per rank: all_to_all -> ForeMoE  pairs on replicas  loss (ForeMoE)  "
              "loss (all_to_all)")
        for (s, m, before, after, rep), a, b in zip(log, with_fm, without):
            print(f"{s:4d} {m:5d}  {before:34.3f} -> {after:7.3f}  {rep:17d}  {a:14.10f}  {b:17.10f}")
        diff = max(abs(a - b) / abs(b) for a, b in zip(with_fm, without))
        print(f"largest relative loss difference with and without ForeMoE: {diff:.1e}")
        if diff > 1e-10:
            sys.exit(f"losses differ by {diff:.1e}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(worker, args=(tmp,), nprocs=WORLD, start_method="spawn")
    print("done")
