"""verl-style integration, part 2: routing-aware micro-batches chosen before the stage runs.

`verl_style.py` plans the micro-batches a trainer already made. Here the micro-batches themselves are chosen from
the routing: with dynamic batch sizing verl's actor calls `rearrange_micro_batches(batch, max_token_len)`, which
returns per micro-batch the sample indices (token-balanced); the recompute stage (old log-probs) runs them and
puts the outputs back in the batch's order with `get_reverse_idx`, and the update stage runs them again.
`foremoe.torch.pack_from_verl` returns a packing of the same shape (the same number of micro-batches, the same
token limit) whose micro-steps carry close to the step's share of every expert's load; its indices go exactly where
`rearrange_micro_batches`' went. What the trainer must keep:

- the loss normalised over the mini-batch (token sum / the mini-batch's tokens), not per micro-batch: then
  gradient accumulation sums the same terms whatever the packing, and the update equals the trainer's own one up to
  floating-point summation order (checked below, float64);
- the same micro-batches in recompute and update (the packing is made once per step, before the first stage), so
  the driver's micro-step `m` and its plan are the same placement in both.

One process plays one data-parallel rank (ranks=1: each rank packs its own samples); the expert layers are the
plain single-process ones, with a comment where `BalancedMoE` takes the driver's plan.

Run: python examples/python/verl_packing.py   (needs torch)
"""

import numpy as np
import torch

import foremoe
import foremoe.torch as ft
from _data import routed_ids

rng = np.random.default_rng(0)
bs, seq, L, E, K, V, H = 24, 96, 2, 16, 2, 32, 16
G = 4  # expert-parallel GPUs: expert e lives on GPU e // (E // G)
owners = np.arange(E) // (E // G)

# --- what rollout hands the actor (left-padded prompts + responses; padding routes to expert 0 as in verl) ------
lengths = rng.integers(16, seq + 1, size=bs)
attention_mask = torch.zeros((bs, seq), dtype=torch.int64)
routed = torch.zeros((bs, seq, L, K), dtype=torch.int64)
tokens = torch.zeros((bs, seq), dtype=torch.int64)
for i, n in enumerate(lengths):
    attention_mask[i, seq - n:] = 1
    routed[i, seq - n:] = torch.from_numpy(routed_ids(rng, int(n), L, E, K, skew=2.0, dtype=np.int64))
    tokens[i, seq - n:] = torch.from_numpy(rng.integers(0, V, int(n)))
advantages = torch.from_numpy(rng.standard_normal(bs))
batch = {"input_ids": tokens, "attention_mask": attention_mask, "routed_experts": routed}

# --- the trainer's micro-batch shape: M micro-batches of at most max_token_len tokens -----------------------------
M = 4
max_token_len = int(lengths.sum()) // M + int(lengths.max())
# verl: micro_bsz_idx = rearrange_micro_batches(batch, max_token_len) (token-balanced); its stand-in here:
tm, _ = foremoe.pack_by_tokens(lengths, micro_steps=M, token_budget=max_token_len)
trainer_idx = [np.flatnonzero(tm == m).tolist() for m in range(M)]

# --- ForeMoE, once per step before the first stage: the packing and the driver of its micro-steps ----------------
packing = ft.pack_from_verl(batch["routed_experts"], batch["attention_mask"], num_experts=E, micro_steps=M,
                            token_budget=max_token_len, gpu_of=owners)
micro_bsz_idx = packing.micro_batches(rank=0)  # where rearrange_micro_batches' output goes
revert_idx = packing.order(rank=0)  # where get_reverse_idx(indices) goes
topo = foremoe.Topology(1, G, E // G + 2)  # 2 spare slots per GPU for replicas
planner = foremoe.Planner(topo)
# With several ranks: each rank packs its own samples and passes group=ep_group (the loads are summed over it).
driver = ft.ReplayDriver.from_packing(planner, packing, owners=owners, num_layers=L)


def gpu_max_over_mean(loads):
    """Per micro-step, the busiest GPU over the mean under the owners' placement (no replicas), layers averaged."""
    per_gpu = np.stack([loads[..., owners == g].sum(axis=-1) for g in range(G)], axis=-1)  # [M, L, G]
    return (per_gpu.max(axis=-1) / per_gpu.mean(axis=-1)).mean(axis=-1)


trainer_loads = ft.loads_from_verl(routed, attention_mask, trainer_idx, num_experts=E)
print(f"{bs} samples, {int(lengths.sum())} tokens, {M} micro-batches of at most {max_token_len} tokens")
print("micro-step max/mean GPU load, owners' placement: trainer's packing",
      np.round(gpu_max_over_mean(trainer_loads), 3).tolist(), "-> routing-aware",
      np.round(gpu_max_over_mean(packing.loads), 3).tolist())
trainer_plans = planner.plan(trainer_loads, owners=owners)
packed_plans = [driver.plan(m) for m in range(M)]  # planned in the driver's thread meanwhile
for name, plans in (("trainer's packing", trainer_plans), ("routing-aware", packed_plans)):
    print(f"foremoe plans over the {name}: max/mean {np.mean([p.imbalance.mean() for p in plans]):.3f}, "
          f"{sum(p.num_moves for p in plans)} weight moves")


# --- a tiny MoE language model whose routing is replayed (ids from rollout, weights from the current router) -----
class TinyMoELM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = torch.nn.Parameter(torch.randn(V, H, generator=g, dtype=torch.float64))
        self.routers = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(H, E, generator=g, dtype=torch.float64)
                                                                 / H ** 0.5) for _ in range(L))
        self.experts = torch.nn.ModuleList(ft.SwiGLUExperts(E, H, 2 * H, dtype=torch.float64, generator=g)
                                           for _ in range(L))

    def forward(self, ids, routed_ids, plan=None):
        h = self.emb[ids]
        for layer, (router, experts) in enumerate(zip(self.routers, self.experts)):
            r = routed_ids[:, layer]
            w = torch.softmax((h @ router).gather(1, r), dim=-1)
            # Across ranks: BalancedMoE(experts, slots)(h, r, w, plan), every layer given the micro-step's plan.
            h = h + experts(h, r, w)
        return torch.log_softmax(h @ self.emb.T, dim=-1)


def micro_batch(idx):
    """verl's remove-padding: the valid tokens of the samples `idx`, concatenated, and each token's sample."""
    keep = batch["attention_mask"][idx].bool()
    sample = torch.tensor(idx).unsqueeze(1).expand_as(keep)[keep]
    return batch["input_ids"][idx][keep], batch["routed_experts"][idx][keep], sample


def log_probs(model, idx, plan=None):
    ids, r, sample = micro_batch(idx)
    return model(ids, r, plan).gather(1, ids.unsqueeze(1)).squeeze(1), sample


model = TinyMoELM()
with torch.no_grad():  # the recompute stage: old log-probs per micro-batch, put back in the batch's order
    per_sample = []
    for m, idx in enumerate(micro_bsz_idx):
        lp, sample = log_probs(model, idx, driver.plan(m))
        per_sample += list(lp.split([int(lengths[i]) for i in idx]))  # one row per sample, as verl's padded output
    old_log_prob = [per_sample[j] for j in revert_idx.tolist()]
    whole, _ = log_probs(model, list(range(bs)))
    assert torch.allclose(torch.cat(old_log_prob), whole, rtol=0, atol=1e-12)


def update(micro_batches, per_micro_batch=False):
    """One optimizer step over `micro_batches` with gradient accumulation; the policy-gradient loss's token sum over
    the mini-batch's tokens (`per_micro_batch`: each micro-batch's own mean, averaged: what a packing changes)."""
    net = TinyMoELM()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    total, step_loss = int(attention_mask.sum()), 0.0
    for m, idx in enumerate(micro_batches):
        lp, sample = log_probs(net, idx)  # update: the same micro-batches (and the same driver.plan(m)) as recompute
        old = torch.cat([old_log_prob[i] for i in idx])
        pg = -(torch.exp(lp - old) * advantages[sample])
        loss = pg.sum() / pg.numel() / len(micro_batches) if per_micro_batch else pg.sum() / total
        loss.backward()
        step_loss += float(loss)
    opt.step()
    return step_loss, torch.cat([p.detach().reshape(-1) for p in net.parameters()])


loss_a, w_a = update(trainer_idx)
loss_b, w_b = update(micro_bsz_idx)
diff = float((w_a - w_b).abs().max() / w_a.abs().max())
print(f"loss over the mini-batch: trainer's packing {loss_a:.15f}, routing-aware {loss_b:.15f}; weights after the "
      f"step differ by {diff:.1e} of their largest magnitude")
assert diff <= 1e-12 and abs(loss_a - loss_b) <= 1e-12 * abs(loss_a)
pm_a, _ = update(trainer_idx, per_micro_batch=True)
pm_b, _ = update(micro_bsz_idx, per_micro_batch=True)
print(f"a loss normalised per micro-batch instead would change: {pm_a:.6f} vs {pm_b:.6f}")
driver.close()
print("done")
