"""verl-style integration: per-micro-step plans from `batch["routed_experts"]`.

verl hands the actor a padded batch: `routed_experts` `[bs, seq, L, K]` (left-padded, with `attention_mask`
`[bs, seq]`) and, with dynamic batch sizing, micro-batches as lists of sample indices (`micro_bsz_idx`).
Each sample's valid tokens are a contiguous slice of the C-contiguous batch, so they are counted in place
(no gather, no copy) and summed per micro-batch; the planner then plans every micro-step of the RL step.

Run: python examples/python/verl_style.py   (NumPy only)
"""

import numpy as np

import foremoe
from _data import routed_ids

rng = np.random.default_rng(0)
bs, seq, L, E, K = 32, 512, 8, 64, 4
topo = foremoe.Topology(1, 8, 10)  # 8 owners + 2 spare slots per GPU per layer

# --- what the trainer hands over ---------------------------------------------------------------------------
lengths = rng.integers(64, seq + 1, size=bs)
attention_mask = np.zeros((bs, seq), dtype=np.int64)
routed = np.zeros((bs, seq, L, K), dtype=np.int32)  # padding positions hold 0 (not -1) as in verl
for i, n in enumerate(lengths):
    attention_mask[i, seq - n:] = 1
    routed[i, seq - n:] = routed_ids(rng, int(n), L, E, K, skew=1.2)
batch = {"routed_experts": routed, "attention_mask": attention_mask}
# Dynamic batch sizing: pack samples into micro-batches of at most `max_tokens` valid tokens.
max_tokens = 2048
micro_bsz_idx, cur, cur_tokens = [], [], 0
for i in np.argsort(-lengths):
    if cur and cur_tokens + lengths[i] > max_tokens:
        micro_bsz_idx.append(cur)
# Routing-aware micro-batches of the same shape replace micro_bsz_idx (and verl's rearrange_micro_batches output):
# foremoe.torch.pack_from_verl(routed, attention_mask, ...).micro_batches(rank), shown in verl_packing.py.
        cur, cur_tokens = [], 0
    cur.append(int(i))
    cur_tokens += int(lengths[i])
micro_bsz_idx.append(cur)


# --- ForeMoE -----------------------------------------------------------------------------------------------
def micro_step_loads(batch, micro_bsz_idx, num_experts):
    """[M, L, E] loads: each sample's valid (left-padded) tokens counted in place, summed per micro-batch."""
    ids, mask = batch["routed_experts"], batch["attention_mask"]
    n_valid = mask.sum(axis=1)
    out = []
    for idx in micro_bsz_idx:
        acc = None
        for i in idx:
            view = ids[i, ids.shape[1] - n_valid[i]:]  # [len, L, K], a view into the batch
            c = foremoe.count_loads(view, num_experts=num_experts)[0]
            acc = c if acc is None else acc + c
        out.append(acc)
    return np.stack(out)


loads = micro_step_loads(batch, micro_bsz_idx, E)
planner = foremoe.Planner(topo, strategy="foremoe")
plans = planner.plan(loads)  # one Plan per micro-step, owners from the step's sum
static = foremoe.Planner(topo, strategy="static").plan(loads)

assert loads.sum() == attention_mask.sum() * L * K
print(f"{len(micro_bsz_idx)} micro-batches, {int(attention_mask.sum())} tokens, loads {loads.shape}")
for m, (p, s) in enumerate(zip(plans, static)):
    print(f"micro-step {m}: max/mean GPU load static {s.imbalance.mean():.3f} -> foremoe {p.imbalance.mean():.3f}, "
          f"{p.num_moves} weight moves")
# What a trainer would apply for micro-step 0: which expert sits in each slot, and the weight copies to make.
print("layer 0 GPU 0 slots:", plans[0].gpu_slots[0, 0].tolist(), "tokens:", plans[0].slot_tokens[0, 0].tolist())
# The last placement is the next RL step's resident placement.
next_step = planner.plan(loads, resident=plans[-1])
print("next step planned from the resident placement:", len(next_step), "micro-steps")
