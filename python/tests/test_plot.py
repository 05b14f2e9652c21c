"""``python -m foremoe simulate --plot DIR`` and ``plan --plot FILE``: real, non-blank pictures; the program's
output unchanged; bad destinations and a missing matplotlib are one-line errors before any work."""

import json
import re
import subprocess
import sys

import numpy as np
import pytest

CFG = {
    "model": {"layers": 4, "experts": 16, "topk": 2, "hidden": 1024, "expert_ffn": 512},
    "topology": {"nodes": 1, "gpus_per_node": 4, "slots": 6},
    "batch": {"steps": 2, "prompts": 8, "responses": 4, "prompt_mean": 64, "response_mean": 128,
              "microbatch_tokens": 512},
}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _py(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "foremoe", *args], capture_output=True, text=True, timeout=timeout)


def _assert_picture(path):
    """A PNG that matplotlib reads back, of a reasonable size, with many colours and real contrast."""
    image = pytest.importorskip("matplotlib.image")
    assert path.is_file(), path
    assert path.read_bytes()[:8] == PNG_MAGIC, path
    img = image.imread(str(path))
    assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 300, (path, img.shape)
    rgb = img[..., :3].reshape(-1, 3)
    colours = np.unique(np.round(rgb * 255).astype(np.uint8), axis=0)
    assert len(colours) > 30, (path, len(colours))
    assert rgb.std() > 0.05, (path, rgb.std())
    # Not just a frame: ink beyond the near-white background covers a real part of the picture.
    assert (rgb.min(axis=1) < 0.8).mean() > 0.02, path


@pytest.fixture()
def cfg(tmp_path):
    p = tmp_path / "cfg.json"
    p.write_text(json.dumps(CFG))
    return p


def test_simulate_plot_writes_three_pictures_and_keeps_stdout(cfg, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "pictures" / "run1"  # made, parents too
    drawn = _py("simulate", "--config", str(cfg), "--csv", "--plot", str(out))
    assert drawn.returncode == 0, drawn.stderr
    names = sorted(p.name for p in out.iterdir())
    assert names == ["gpu_load_layer0.png", "layer_imbalance.png", "step_breakdown.png"]
    for name in names:
        _assert_picture(out / name)
        assert f"wrote {out / name}" in drawn.stderr
    plain = _py("simulate", "--config", str(cfg), "--csv")
    assert plain.returncode == 0 and drawn.stdout == plain.stdout and plain.stdout.startswith("strategy,")


def test_simulate_plot_layer_and_quiet(cfg, tmp_path):
    pytest.importorskip("matplotlib")
    r = _py("simulate", "--config", str(cfg), "--gpu-load-layer", "3", f"--plot={tmp_path}", "--quiet",
            "--strategies", "static,foremoe")
    assert r.returncode == 0, r.stderr
    _assert_picture(tmp_path / "gpu_load_layer3.png")
    assert "wrote" not in r.stderr
    bad = _py("simulate", "--config", str(cfg), "--gpu-load-layer", "4", "--plot", str(tmp_path / "x"))
    assert bad.returncode != 0 and "gpu_load_layer 4" in bad.stderr and "Traceback" not in bad.stderr


def _loads(tmp_path):
    rng = np.random.default_rng(11)
    loads = rng.poisson(np.exp(1.5 * rng.standard_normal((1, 3, 16))) * 100, size=(3, 3, 16)).astype(np.int64)
    np.save(tmp_path / "l.npy", loads)
    return ["plan", "--loads", str(tmp_path / "l.npy"), "--nodes", "2", "--gpus-per-node", "2", "--slots", "5"]


def test_plan_plot_draws_the_chosen_layer(tmp_path):
    pytest.importorskip("matplotlib")
    args = _loads(tmp_path)
    png = tmp_path / "placement.png"
    drawn = _py(*args, "--plot", str(png), "--out", str(tmp_path / "plan.json"))
    assert drawn.returncode == 0, drawn.stderr
    _assert_picture(png)
    plain = _py(*args, "--out", str(tmp_path / "plan.json"))
    strip = lambda s: re.sub(r"in [0-9.]+ ms", "in T ms", s)  # noqa: E731  (planner wall time)
    assert strip(drawn.stdout) == strip(plain.stdout)
    chosen = tmp_path / "m1l2.png"
    r = _py(*args, "--plot", str(chosen), "--plot-micro-step", "1", "--plot-layer", "2")
    assert r.returncode == 0, r.stderr
    _assert_picture(chosen)
    bad = _py(*args, "--plot", str(tmp_path / "bad.png"), "--plot-layer", "3")
    assert bad.returncode == 2 and "--plot-layer 3" in bad.stderr and "0 .. 2" in bad.stderr
    assert "Traceback" not in bad.stderr and not (tmp_path / "bad.png").exists()


def test_most_imbalanced_is_the_default(tmp_path):
    pytest.importorskip("matplotlib")
    from foremoe import plot

    args = _loads(tmp_path)
    assert _py(*args, "--out", str(tmp_path / "plan.json")).returncode == 0
    doc = json.loads((tmp_path / "plan.json").read_text())
    imb = np.array([[lp["imbalance"] for lp in step["layers"]] for step in doc["micro_steps"]])
    m, layer, how = plot.choose_layer(doc, None, None)
    assert imb[m, layer] == imb.max() and "most imbalanced" in how
    m, layer, _ = plot.choose_layer(doc, None, 1)
    assert layer == 1 and imb[m, 1] == imb[:, 1].max()


@pytest.mark.parametrize("command", ["simulate", "plan"])
def test_unwritable_destination_fails_before_any_work(tmp_path, command):
    pytest.importorskip("matplotlib")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    # The default simulate runs for seconds and prints its table; a refused destination must stop it first.
    args = ["simulate"] if command == "simulate" else _loads(tmp_path)
    dest = blocker / "pictures" if command == "simulate" else blocker / "p.png"
    r = _py(*args, "--plot", str(dest), timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stdout == "" and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--plot" in lines[0] and str(blocker) in lines[0], r.stderr


def test_plan_plot_needs_a_picture_format(tmp_path):
    pytest.importorskip("matplotlib")
    r = _py(*_loads(tmp_path), "--plot", str(tmp_path / "placement.txt"))
    assert r.returncode == 2 and ".png" in r.stderr and r.stdout == ""
    r = _py(*_loads(tmp_path), "--plot", str(tmp_path / "p.png"), "--strategy", "all")
    assert r.returncode == 2 and "--traffic-aware and --node-hits need one strategy" in r.stderr


def test_without_matplotlib_plot_is_a_one_line_error(tmp_path):
    # matplotlib made unimportable in the child, whether or not it is installed here.
    code = ("import sys; sys.modules['matplotlib'] = None; from foremoe.__main__ import main; "
            f"sys.exit(main(['simulate', '--plot', {str(tmp_path / 'p')!r}]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "matplotlib" in r.stderr and "python[plot]" in r.stderr, r.stderr
    assert not (tmp_path / "p").exists()


def test_plot_options_need_plot(tmp_path):
    r = _py(*_loads(tmp_path), "--plot-layer", "1")
    assert r.returncode == 2 and "give --plot FILE" in r.stderr


def test_the_program_itself_refuses_plot(cli, tmp_path):
    r = subprocess.run([cli, "simulate", "--plot", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "python -m foremoe simulate --plot" in r.stderr
