"""Skewed routed ids for the examples (a stand-in for a real router; no trainer needed)."""

import numpy as np


def routed_ids(rng: np.random.Generator, num_tokens: int, num_layers: int, num_experts: int, topk: int,
               skew: float = 1.0, dtype=np.int32) -> np.ndarray:
    """[num_tokens, num_layers, topk] distinct experts per token and layer, lognormal-skewed popularity."""
    out = np.empty((num_tokens, num_layers, topk), dtype=dtype)
    for l in range(num_layers):
        w = np.exp(skew * rng.standard_normal(num_experts))
        # Gumbel top-k: distinct experts drawn in proportion to w.
        g = np.log(w)[None, :] - np.log(-np.log(rng.random((num_tokens, num_experts))))
        out[:, l, :] = np.argpartition(-g, topk - 1, axis=1)[:, :topk]
    return out
