"""Pictures of ``foremoe simulate`` results and ``foremoe plan`` placements (matplotlib, Agg backend).

Needs the ``plot`` extra (``pip install ./python[plot]``, i.e. matplotlib); everything else in the package runs
without it. The pictures are drawn from the documents the program writes (the simulate results as ``--json``
writes them, PLAN.json as ``--out`` writes it), so they show exactly what the tables print.

- :func:`simulate_figures`: ``step_breakdown.png`` (where a step's time goes, per strategy),
  ``gpu_load_layer<L>.png`` (per-GPU load of one layer over the micro-steps under static, eplb and foremoe) and
  ``layer_imbalance.png`` (the distribution of every layer's max/mean GPU load, per strategy).
- :func:`plan_figure`: one micro-step and layer of a plan: GPUs x slots, owners and replicas, tokens.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Any, List, Mapping, Optional, Tuple

import numpy as np

__all__ = ["PlotError", "check_plot_dir", "check_plot_file", "choose_layer", "plan_figure", "pyplot",
           "simulate_figures"]

#: What ``--plot`` says when matplotlib is missing.
MISSING = ("--plot needs matplotlib, the package's optional 'plot' extra: pip install './python[plot]' "
           "(or pip install matplotlib)")

#: The strategies of the per-GPU load picture, in this order (those present in the results).
GPU_LOAD_STRATEGIES = ("static", "eplb", "foremoe")

#: Colours of owner copies and replicas in the placement picture.
OWNER, REPLICA = "#4C72B0", "#DD8452"

#: Breakdown fields of the simulate document, their labels and colours, bottom to top.
BREAKDOWN = (
    ("expert_compute_seconds", "expert compute (slowest GPU)", "#4C72B0"),
    ("all_to_all_seconds", "all-to-all", "#DD8452"),
    ("dense_seconds", "dense (attention etc.)", "#8C8C8C"),
    ("lm_head_seconds", "LM head", "#937860"),
    ("moves_seconds", "moves (re-owning, mirror refresh)", "#55A868"),
    ("stall_seconds", "stall (waiting for weights/gradients)", "#C44E52"),
    ("dp_grad_sync_seconds", "expert-gradient sync across EP-group copies", "#DA8BC3"),
    ("optimizer_seconds", "optimizer", "#8172B3"),
    ("tp_comm_seconds", "tensor-parallel collectives", "#CCB974"),
    ("pipeline_seconds", "pipeline bubble and stage sends", "#64B5CD"),
)


class PlotError(Exception):
    """A ``--plot`` problem to report in one line (missing matplotlib, unwritable destination, bad choice)."""


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (no display needed); :class:`PlotError` when matplotlib is absent."""
    try:
        import matplotlib
    except ImportError as e:
        raise PlotError(MISSING) from e
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _writable_dir(d: Path, what: str) -> None:
    if not d.is_dir():
        raise PlotError(f"{what}: '{d}' is not a folder")
    if not os.access(d, os.W_OK | os.X_OK):
        raise PlotError(f"{what}: folder '{d}' is not writable")


def check_plot_dir(path: str) -> Path:
    """Checks (before any work) that ``path`` is a writable folder or can be made one, and makes it."""
    d = Path(path)
    if path == "" or (d.exists() and not d.is_dir()):
        raise PlotError(f"--plot '{path}' is not a folder")
    if not d.exists():
        parent = d.parent
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
        _writable_dir(parent, f"--plot '{path}'")
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise PlotError(f"--plot '{path}': cannot make the folder: {e.strerror or e}") from e
    _writable_dir(d, "--plot")
    return d


def check_plot_file(path: str) -> Path:
    """Checks (before any work) that a picture can be written at ``path``: a writable folder, a known format."""
    p = Path(path)
    if path == "" or p.is_dir():
        raise PlotError(f"--plot '{path}' is a folder, not a file")
    formats = pyplot().figure().canvas.get_supported_filetypes()
    pyplot().close("all")
    suffix = p.suffix.lower().lstrip(".")
    if suffix not in formats:
        raise PlotError(f"--plot '{path}': the picture format follows the file name's extension; use one of "
                        + ", ".join("." + f for f in sorted(formats)))
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise PlotError(f"--plot '{path}': folder '{parent}' does not exist")
    _writable_dir(parent, f"--plot '{path}'")
    if p.exists() and not os.access(p, os.W_OK):
        raise PlotError(f"--plot '{path}' is not writable")
    return p


def _setting(doc: Mapping[str, Any], section: str, key: str) -> Any:
    return doc.get("config", {}).get(section, {}).get(key)


def _simulate_title(doc: Mapping[str, Any]) -> str:
    """Workload, model and cluster of a simulate document, for a figure's title."""
    steps, micro = doc["num_steps"], doc["num_micro_steps"]
    topk = _setting(doc, "model", "topk")
    model = f"{doc['num_layers']} MoE layers x {doc['num_experts']} experts" + (f", top-{topk}" if topk else "")
    cluster = f"{doc['nodes']} x {doc['gpus_per_node']} GPUs, {doc['slots']} slots/GPU/layer"
    if doc.get("num_ep_groups", 1) > 1:
        cluster += f" ({doc['num_ep_groups']} EP groups of {doc['ep_size']})"
    prompts, responses = _setting(doc, "batch", "prompts"), _setting(doc, "batch", "responses")
    batch = f"workload {doc.get('workload', '?')}"
    if prompts and responses and doc.get("workload") == "grpo":
        batch += f" ({prompts} prompts x {responses} responses)"
    batch += f", {steps} RL step{'s' if steps != 1 else ''} ({micro} micro-steps)"
    return f"{model}; {cluster}\n{batch}"


def _save(fig: Any, path: Path) -> Path:
    fig.savefig(path, dpi=110, bbox_inches="tight")
    pyplot().close(fig)
    return path


def _breakdown_figure(doc: Mapping[str, Any], path: Path) -> Path:
    plt = pyplot()
    rows = doc["strategies"]
    names = [r["strategy"] for r in rows]
    fields = [f for f in BREAKDOWN if any(r["breakdown"][f[0]] > 0 for r in rows)]
    fig, ax = plt.subplots(figsize=(max(7.0, 1.1 * len(rows) + 3.0), 5.2))
    bottom = [0.0] * len(rows)
    for key, label, colour in fields:
        vals = [r["breakdown"][key] for r in rows]
        ax.bar(names, vals, bottom=bottom, label=label, color=colour, width=0.65)
        bottom = [b + v for b, v in zip(bottom, vals)]
    top = max(bottom) if bottom else 1.0
    for i, r in enumerate(rows):
        # Moves and stall are often a sliver of the bar: their sum in ms, so that a reader need not guess.
        hidden = (r["breakdown"]["moves_seconds"] + r["breakdown"]["stall_seconds"]) * 1e3
        ax.annotate(f"{r['step_seconds']:.3f} s\nmoves+stall\n{hidden:.1f} ms", (i, bottom[i]), xytext=(0, 3),
                    textcoords="offset points", ha="center", va="bottom", fontsize=7)
    ax.set_ylim(0, top * 1.2)
    ax.set_ylabel("seconds per RL step (training: recompute + update)")
    ax.set_xlabel("strategy")
    ax.tick_params(axis="x", labelrotation=20)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, title="part of the step", title_fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    ax.set_title("Step-time breakdown per strategy (mean per counted RL step)\n" + _simulate_title(doc), fontsize=9)
    return _save(fig, path)


def _gpu_load_figure(doc: Mapping[str, Any], path: Path) -> Path:
    plt = pyplot()
    from matplotlib.colors import TwoSlopeNorm

    rows = {r["strategy"]: r for r in doc["strategies"]}
    names = [n for n in GPU_LOAD_STRATEGIES if n in rows]
    if not names:  # other strategies were asked for: the first three that plan
        names = [r["strategy"] for r in doc["strategies"] if r["strategy"] != "ideal"][:3]
    if not names:
        names = [doc["strategies"][0]["strategy"]]
    layer = doc.get("gpu_load_layer", 0)
    rel = {}
    for n in names:
        load = np.asarray(rows[n]["micro_step_gpu_load"], dtype=float)  # [micro-step, gpu]
        mean = load.mean(axis=1, keepdims=True)
        rel[n] = np.divide(load, mean, out=np.ones_like(load), where=mean > 0).T  # [gpu, micro-step]
    vmax = max(1.05, max(float(r.max()) for r in rel.values()))
    # Symmetric about 1 (so equal colours mean equal deviations) unless loads near 0 force a longer lower half.
    vmin = min(max(0.0, 2.0 - vmax), min(float(r.min()) for r in rel.values()))
    norm = TwoSlopeNorm(vmin=min(vmin, 0.95), vcenter=1.0, vmax=vmax)
    gpus, micro = next(iter(rel.values())).shape
    height = min(3.2, 0.9 + 0.035 * gpus)
    fig, axes = plt.subplots(len(names) + 1, 1, figsize=(max(8.0, 3.0 + 0.09 * micro), height * len(names) + 2.4),
                             sharex=True, gridspec_kw={"height_ratios": [height] * len(names) + [2.0]}, layout="constrained")
    im = None
    for ax, n in zip(axes, names):
        im = ax.imshow(rel[n], aspect="auto", interpolation="nearest", cmap="RdBu_r", norm=norm,
                       extent=(-0.5, micro - 0.5, gpus - 0.5, -0.5))
        ax.set_ylabel(f"{n}\nGPU")
        ax.yaxis.set_major_locator(plt.MaxNLocator(integer=True, nbins=6))
    line = axes[-1]
    for n in names:
        line.plot(np.arange(micro), rel[n].max(axis=0), label=n, lw=1.2)
    line.axhline(1.0, color="black", lw=0.6, ls=":")
    line.set_ylabel(f"layer {layer}\nmax/mean")
    line.set_xlabel("simulated micro-step (per RL step: recompute pass(es), then update)")
    line.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
    peak = max(float(r.max(axis=0).max()) for r in rel.values())
    line.set_ylim(min(0.95, line.get_ylim()[0]), 1.0 + (peak - 1.0) * 1.45 + 0.05)  # room for the legend
    line.legend(fontsize=8, loc="upper right", ncol=len(names), title="strategy", title_fontsize=8)
    line.grid(alpha=0.3)
    cbar = fig.colorbar(im, ax=list(axes[:-1]), fraction=0.03, pad=0.01, aspect=40)
    cbar.set_label("GPU load / mean GPU load\n(1 = balanced; red = overloaded)", fontsize=8)
    note = ", GPUs of the slowest EP group" if doc.get("num_ep_groups", 1) > 1 else ""
    axes[0].set_title(f"Per-GPU token load of MoE layer {layer} over the micro-steps{note}\n" + _simulate_title(doc),
                      fontsize=9)
    return _save(fig, path)


def _imbalance_figure(doc: Mapping[str, Any], path: Path) -> Path:
    plt = pyplot()

    rows = list(doc["strategies"])
    data = [np.asarray(r["micro_step_layer_imbalance"], dtype=float).ravel() for r in rows]
    fig, ax = plt.subplots(figsize=(9.0, 0.55 * len(rows) + 2.2))
    pos = np.arange(len(rows))[::-1]  # the first strategy on top, as in the table
    # Nearest-rank quantiles, as the table's median and p99 (numpy's interpolated ones would disagree with it).
    def rank(d: np.ndarray, q: float) -> float:
        return float(d[min(len(d) - 1, max(0, int(np.ceil(q * len(d))) - 1))])

    stats = []
    for d, r in zip(data, rows):
        d = np.sort(d) if d.size else np.ones(1)
        stats.append({"label": r["strategy"], "med": rank(d, 0.5), "q1": rank(d, 0.25), "q3": rank(d, 0.75),
                      "whislo": rank(d, 0.01), "whishi": rank(d, 0.99), "fliers": []})
    # matplotlib >= 3.10 names the direction `orientation` (3.11 deprecates `vert`).
    horizontal = {"orientation": "horizontal"} if "orientation" in inspect.signature(ax.bxp).parameters else {
        "vert": False}
    ax.bxp(stats, positions=pos, showfliers=False, widths=0.6, medianprops={"color": "black"}, **horizontal)
    hi = max(float(d.max()) if d.size else 1.0 for d in data)
    for y, d, r in zip(pos, data, rows):
        if d.size:
            ax.plot([d.max()], [y], marker="x", color="#C44E52", ms=5)
        ax.text(1.01, y, f"median {r['imbalance_median']:.3f}\np99 {r['imbalance_p99']:.3f}", va="center",
                fontsize=8, transform=ax.get_yaxis_transform())  # beside the axes, as in the table
    ax.set_yticks(pos)
    ax.set_yticklabels([r["strategy"] for r in rows])
    ax.axvline(1.0, color="black", lw=0.6, ls=":")
    ax.set_xlim(min(0.98, min(float(d.min()) for d in data if d.size) - 0.02), hi * 1.05)
    ax.set_xlabel("layer max/mean GPU load (1 = perfectly balanced), every simulated micro-step and layer")
    ax.grid(axis="x", alpha=0.3)
    ax.set_title("Distribution of per-layer imbalance (box: quartiles; whiskers: 1st-99th percentile; x: max)\n"
                 + _simulate_title(doc), fontsize=9)
    return _save(fig, path)


def simulate_figures(doc: Mapping[str, Any], out_dir: os.PathLike) -> List[Path]:
    """Draws the pictures of a simulate results document (``foremoe simulate --json``, :func:`foremoe.simulate`)
    into ``out_dir``; returns the files written."""
    d = Path(out_dir)
    layer = doc.get("gpu_load_layer", 0)
    return [
        _breakdown_figure(doc, d / "step_breakdown.png"),
        _gpu_load_figure(doc, d / f"gpu_load_layer{layer}.png"),
        _imbalance_figure(doc, d / "layer_imbalance.png"),
    ]


def choose_layer(doc: Mapping[str, Any], micro_step: Optional[int], layer: Optional[int]) -> Tuple[int, int, str]:
    """The (micro-step, layer) to draw and how it was chosen: both given, one given (the other: the most
    imbalanced with it fixed), or neither (the most imbalanced of all)."""
    num_micro, num_layers = len(doc["micro_steps"]), doc["num_layers"]
    if micro_step is not None and not 0 <= micro_step < num_micro:
        raise PlotError(f"--plot-micro-step {micro_step}: the plan has micro-steps 0 .. {num_micro - 1}")
    if layer is not None and not 0 <= layer < num_layers:
        raise PlotError(f"--plot-layer {layer}: the plan has layers 0 .. {num_layers - 1}")
    if micro_step is not None and layer is not None:
        return micro_step, layer, "as chosen"
    cells = [(m, l) for m in range(num_micro) for l in range(num_layers)
             if (micro_step is None or m == micro_step) and (layer is None or l == layer)]
    m, l = max(cells, key=lambda c: (doc["micro_steps"][c[0]]["layers"][c[1]]["imbalance"], -c[0], -c[1]))
    if micro_step is None and layer is None:
        how = f"the most imbalanced of {num_micro} micro-steps x {num_layers} layers"
    elif micro_step is None:
        how = f"layer as chosen; its most imbalanced of {num_micro} micro-steps"
    else:
        how = f"micro-step as chosen; its most imbalanced of {num_layers} layers"
    return m, l, how


def plan_figure(doc: Mapping[str, Any], path: os.PathLike, micro_step: Optional[int] = None,
                layer: Optional[int] = None) -> Tuple[Path, int, int]:
    """Draws one micro-step and layer of a PLAN.json (``foremoe plan --out``): per GPU its slots (expert id, owner
    or replica, tokens) and its total load against the mean. Returns the file and the (micro-step, layer) drawn."""
    plt = pyplot()
    from matplotlib.patches import Patch

    m, l, how = choose_layer(doc, micro_step, layer)
    lp = doc["micro_steps"][m]["layers"][l]
    slots = np.asarray(lp["gpu_slots"], dtype=np.int64)  # [gpu, slot]: expert or -1
    tokens = np.asarray(lp["slot_tokens"], dtype=np.int64)  # [gpu, slot]
    owner = np.asarray(lp["owner_gpu"], dtype=np.int64)  # [expert]
    gpus, num_slots = slots.shape
    gpn = doc.get("gpus_per_node", gpus)
    is_owner = np.zeros_like(slots, dtype=bool)
    for g in range(gpus):
        for s in range(num_slots):
            e = slots[g, s]
            is_owner[g, s] = e >= 0 and owner[e] == g
    per_gpu = tokens.sum(axis=1)
    mean = per_gpu.mean() if gpus else 0.0

    two_lines = gpus <= 32  # room for "e12 r" over the token count
    row_h = 0.42 if two_lines else 0.16
    font = 7 if num_slots <= 12 else 6
    if not two_lines:
        font = 5
    cell_w = 0.62 if two_lines else 0.75
    fig, (grid, bars) = plt.subplots(
        1, 2, figsize=(max(4.0, cell_w * num_slots) + 5.5, 2.4 + row_h * gpus), sharey=True,
        gridspec_kw={"width_ratios": [max(4.0, cell_w * num_slots), 3.5]}, layout="constrained")
    cmap = plt.get_cmap("viridis")
    tmax = max(1, int(tokens.max()))
    for g in range(gpus):
        for s in range(num_slots):
            e = slots[g, s]
            if e < 0:
                grid.add_patch(plt.Rectangle((s - 0.5, g - 0.5), 1, 1, facecolor="#EEEEEE", edgecolor="white"))
                grid.text(s, g, "empty", ha="center", va="center", fontsize=font, color="#888888")
                continue
            colour = cmap(tokens[g, s] / tmax)
            grid.add_patch(plt.Rectangle((s - 0.5, g - 0.5), 1, 1, facecolor=colour, edgecolor="white", lw=0.8))
            if not is_owner[g, s]:  # a replica: an orange frame, as in the bars
                grid.add_patch(plt.Rectangle((s - 0.44, g - 0.42), 0.88, 0.84, facecolor="none",
                                             edgecolor=REPLICA, lw=2.0))
            dark = sum(colour[:3]) < 1.5
            sep = "\n" if two_lines else " "
            label = f"e{e}{'' if is_owner[g, s] else ' r'}{sep}{tokens[g, s]}"
            grid.text(s, g, label, ha="center", va="center", fontsize=font, color="white" if dark else "black")
    grid.set_xlim(-0.5, num_slots - 0.5)
    grid.set_ylim(gpus - 0.5, -0.5)
    grid.set_xticks(range(num_slots))
    grid.set_xticklabels([str(s) for s in range(num_slots)], fontsize=8)
    step = 1 if gpus <= 32 else max(1, gpus // 32)
    grid.set_yticks(range(0, gpus, step))
    grid.set_yticklabels([f"GPU {g} (node {g // gpn})" for g in range(0, gpus, step)], fontsize=7 if two_lines else 6)
    grid.set_xlabel("slot (cell: expert id, r = replica, over its tokens; colour: tokens)", fontsize=8)
    for g in range(gpn, gpus, gpn):
        grid.axhline(g - 0.5, color="black", lw=1.0)
        bars.axhline(g - 0.5, color="black", lw=0.6, alpha=0.5)

    left = np.zeros(gpus)
    for s in range(num_slots):
        w = tokens[:, s]
        colours = [OWNER if is_owner[g, s] else REPLICA for g in range(gpus)]
        bars.barh(range(gpus), w, left=left, color=colours, edgecolor="white", lw=0.5, height=0.75)
        left += w
    bars.axvline(mean, color="black", ls="--", lw=1.0)
    bars.set_xlim(0, max(1.0, float(per_gpu.max())) * 1.06)
    bars.set_xlabel("tokens per GPU (one segment per slot)", fontsize=8)
    bars.tick_params(axis="x", labelsize=7)
    bars.xaxis.set_major_locator(plt.MaxNLocator(nbins=4))
    bars.grid(axis="x", alpha=0.3)
    bars.legend(handles=[Patch(color=OWNER, label="owner copy"), Patch(color=REPLICA, label="replica"),
                         plt.Line2D([], [], color="black", ls="--", label=f"mean {mean:,.0f}")],
                fontsize=7, loc="upper left", bbox_to_anchor=(0.0, -0.12 if two_lines else -0.04), ncol=3,
                frameon=False)
    sm = plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(0, tmax))
    cbar = fig.colorbar(sm, ax=grid, location="top", fraction=0.04 if gpus > 16 else 0.05, pad=0.02, aspect=40)
    cbar.set_label("tokens in the slot", fontsize=7)
    cbar.ax.tick_params(labelsize=7)
    replicas = int((~is_owner & (slots >= 0)).sum())
    fig.suptitle(f"{doc.get('strategy', '?')} plan: micro-step {m}, layer {l} ({how})\n"
                 f"max/mean GPU load {lp['imbalance']:.4f}, {replicas} replicas, {len(lp['moves'])} moves; "
                 f"{doc['nodes']} x {doc['gpus_per_node']} GPUs x {doc['slots']} slots, {doc['num_experts']} experts",
                 fontsize=9)
    return _save(fig, Path(path)), m, l
