"""Balanced expert parallelism in a Megatron-core RL trainer: foremoe.megatron with router replay.

The loop of an RL step, as verl or slime run it on Megatron-core:
  1. rollout: the routers record each micro-batch's top-k experts (RouterReplayAction.RECORD);
  2. update: the same micro-batches replay that routing (REPLAY_FORWARD); forward + backward per micro-batch,
     gradients accumulated, then one optimizer step.
Because the routing is replayed, every micro-step's expert loads are known before the stage runs. ForeMoE plans
each micro-step ahead (a ReplayDriver, in a background thread), and `balancer.micro_step(m, driver)` hands that plan
to every MoE layer: hot experts get replicas in spare expert rows of other ranks, tokens are split exactly, the
replicas' weight gradients are added to their owners'. The math is unchanged: the loss equals Megatron's own
unbalanced layer's, only the tokens per rank change.

Run: python examples/python/megatron_train.py   (CPU, 2 processes over gloo; needs torch >= 2.6, megatron-core 0.16.1)
"""

import datetime
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD, EXPERTS, TOPK, LAYERS, HIDDEN, FFN = 2, 16, 2, 2, 16, 24
STEPS, MICRO, TOKENS = 2, 3, 48


def rank_main(rank: int, tmp: str) -> None:
    import _megatron_cpu as cpu  # TEST / CPU ONLY: Megatron on a CPU (no GPU here); drop it on GPUs
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    import foremoe
    import foremoe.megatron

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdv", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    cpu.init_megatron(ep=WORLD)  # parallel_state.initialize_model_parallel(expert_model_parallel_size=WORLD)
    cfg = cpu.make_config(layers=LAYERS, hidden=HIDDEN, ffn=FFN, experts=EXPERTS, topk=TOPK, ep=WORLD,
                          dtype=torch.float64)
    model = cpu.TinyMoE(cfg)  # any model with Megatron MoELayers (GPTModel, ...)
    plain = cpu.TinyMoE(cfg)  # the same model without ForeMoE, to compare
    plain.load_state_dict(model.state_dict())

    # --- ForeMoE: once, after building the model, before DDP and the optimizer ---
    balancer = foremoe.megatron.install(model, slots=EXPERTS // WORLD + 2)  # 8 owned experts + 2 replica rows
    planner = foremoe.Planner(balancer.topology())
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, plain)]

    g = torch.Generator().manual_seed(rank)
    for step in range(STEPS):
        hot = torch.randn(MICRO, HIDDEN, generator=torch.Generator().manual_seed(step)) * 0.8  # skewed routing
        batches = [torch.randn(TOKENS, HIDDEN, generator=g, dtype=torch.float64) + hot[m] for m in range(MICRO)]
        # 1. rollout: record the routing of every micro-batch (plain Megatron path: no micro-step is set)
        for m_ in (model, plain):
            cpu.set_action(m_, RouterReplayAction.RECORD)
        recorded = []
        with torch.no_grad():
            for x in batches:
                model(x)
                recorded.append([r.get_recorded_indices() for r in model.routers()])  # RouterReplay.get_recorded_data()
        for m_ in (model, plain):
            cpu.set_action(m_, RouterReplayAction.REPLAY_FORWARD)
        # 2. update stage: one driver plans every micro-step of the stage from the recorded routing
        with balancer.driver(planner, recorded, stage="update") as driver:
            for m, x in enumerate(batches):
                for m_ in (model, plain):
                    cpu.set_targets(m_, recorded[m])  # RouterReplay.set_replay_data(recorded[m])
                with balancer.micro_step(m, driver):  # every MoE layer runs micro-step m's plan
                    loss = model(x).square().mean()
                    loss.backward()
                loss_plain = plain(x).square().mean()  # Megatron's own dispatcher, same routing
                loss_plain.backward()
                calls = balancer.stats[-LAYERS:]  # this micro-step's layer calls (per-call balance figures)
                if rank == 0:
                    worst = max(calls, key=lambda s: s["max_plain"] / s["mean_plain"])
                    print(f"step {step} micro-step {m}: tokens per rank max/mean "
                          f"{worst['max_plain'] / worst['mean_plain']:.2f} without ForeMoE, "
                          f"{worst['max'] / worst['mean']:.2f} with (layer {worst['layer']}); "
                          f"loss {loss.item():.12f} vs {loss_plain.item():.12f}")
                assert abs(loss.item() - loss_plain.item()) <= 1e-12 * abs(loss_plain.item())
        for opt in opts:
            opt.step()
            opt.zero_grad()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(rank_main, args=(tmp,), nprocs=WORLD)
    print("equal losses with and without ForeMoE on every micro-step")
