"""One schema for every front end: for every key of the simulate and planner schemas, the C++ program
(`$FOREMOE_CLI`) and Python accept the same config, refuse the same bad value with the same message, and
write the same output documents."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import foremoe

# A tiny model, cluster and batch so that each run takes milliseconds.
TINY = {
    "model": {"layers": 2, "experts": 8, "topk": 2, "hidden": 64, "expert_ffn": 32},
    "topology": {"nodes": 1, "gpus_per_node": 2, "slots": 5},
    "batch": {"steps": 1, "prompts": 4, "responses": 2, "prompt_mean": 16, "response_mean": 32,
              "microbatch_tokens": 256},
    "strategies": "static,foremoe",
}


@pytest.fixture(scope="module")
def cli_bin():
    path = os.environ.get("FOREMOE_CLI")
    if not path or not os.access(path, os.X_OK):
        pytest.skip("FOREMOE_CLI (the built foremoe binary) not set")
    return path


def with_key(cfg, key, value):
    out = json.loads(json.dumps(cfg))
    node = out
    *sections, last = key.split(".")
    for s in sections:
        node = node.setdefault(s, {})
    node[last] = value
    return out


def bad_value(o):
    """A value of the option's type outside its range, or of the wrong type."""
    if o["type"] == "int":
        return o["max"] + 1 if o["max"] < 2**63 - 1 else o["min"] - 1
    if o["type"] == "float":
        return o["max"] * 2 + 1
    if o["type"] == "enum":
        return "no-such-choice"
    if o["type"] == "bool":
        return 1
    return True


def strip(doc):
    for s in doc["strategies"]:
        for k in ("planner_seconds", "planner_critical_seconds", "step_with_planner_seconds"):  # wall time
            s.pop(k)
    doc.get("best_deployment", {}).pop("search_seconds", None)  # wall time
    return doc


def run_cli(cli_bin, tmp_path, cfg):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    out = tmp_path / "out.json"
    if out.exists():
        out.unlink()
    r = subprocess.run([cli_bin, "simulate", "--quiet", "--config", str(path), "--json", str(out)], capture_output=True,
                       text=True)
    err = r.stderr.strip().removeprefix("foremoe simulate: error: ")
    return r.returncode, err, (strip(json.loads(out.read_text())) if r.returncode == 0 else None)


def run_py(cfg):
    try:
        return 0, "", strip(foremoe.simulate(cfg))
    except ValueError as e:
        return 1, str(e), None


def test_simulate_schema_matches_cli_for_every_key(cli_bin, tmp_path):
    base = foremoe.simulate_config(TINY)
    opts = foremoe.options("simulate")
    assert {o["key"] for o in opts} >= {"batch.seed", "cost.grad_add_gb_per_s", "sim.threads", "topology.slots"}
    for o in opts:
        if o["key"] in ("preset",):
            continue  # a preset resets the tiny shape; checked below
        section, _, name = o["key"].rpartition(".")
        default = base[section][name] if section else base[name]
        # The effective value is accepted by both, with identical documents.
        ok = with_key(TINY, o["key"], default)
        rc_c, err_c, doc_c = run_cli(cli_bin, tmp_path, ok)
        rc_p, err_p, doc_p = run_py(ok)
        assert (rc_c, err_c) == (0, ""), (o["key"], err_c)
        assert rc_p == 0, (o["key"], err_p)
        assert doc_c == doc_p, o["key"]
        # A bad value is refused by both with the same message naming the key.
        bad = with_key(TINY, o["key"], bad_value(o))
        rc_c, err_c, _ = run_cli(cli_bin, tmp_path, bad)
        rc_p, err_p, _ = run_py(bad)
        assert rc_c == 1 and rc_p == 1, (o["key"], err_c, err_p)
        assert err_c == err_p, o["key"]
        assert err_p.startswith(f"config.{o['key']}: "), err_p


def test_preset_and_unknown_keys_match_cli(cli_bin, tmp_path):
    for cfg in ({"preset": "gpt"}, {"modle": {}}, {"model": {"layers": 4.5}}, {"model": 3}):
        rc_c, err_c, _ = run_cli(cli_bin, tmp_path, cfg)
        rc_p, err_p, _ = run_py(cfg)
        assert (rc_c, err_c) == (rc_p, err_p) and rc_p == 1, cfg


def test_print_config_is_simulate_config(cli_bin, tmp_path):
    for preset in ("qwen3-30b-a3b", "deepseek-v3", "kimi-k2"):
        out = subprocess.run([cli_bin, "simulate", "--preset", preset, "--print-config"], capture_output=True,
                             text=True, check=True).stdout
        assert json.loads(out) == foremoe.simulate_config({"preset": preset})
    py = subprocess.run([sys.executable, "-m", "foremoe", "simulate", "--print-config"], capture_output=True,
                        text=True, check=True).stdout
    cli = subprocess.run([cli_bin, "simulate", "--print-config"], capture_output=True, text=True, check=True).stdout
    assert py == cli


def test_python_main_matches_cli_flags_and_csv(cli_bin, tmp_path):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(TINY))
    args = ["simulate", "--config", str(path), "--seed", "5", "--no-reowning-free", "--csv"]
    a = subprocess.run([cli_bin, *args], capture_output=True, text=True)
    b = subprocess.run([sys.executable, "-m", "foremoe", *args], capture_output=True, text=True)
    assert a.returncode == b.returncode == 0
    assert a.stdout == b.stdout and a.stdout.startswith("strategy,")
    bad = ["simulate", "--config", str(path), "--slots", "0"]
    a = subprocess.run([cli_bin, *bad], capture_output=True, text=True)
    b = subprocess.run([sys.executable, "-m", "foremoe", *bad], capture_output=True, text=True)
    assert "--slots must be in [1, 16384], got 0" in a.stderr and "--slots must be in [1, 16384], got 0" in b.stderr


def test_planner_defaults_and_plan_documents_match_cli(cli_bin, tmp_path):
    defaults = {o["key"]: o["default"] for o in foremoe.options("planner")}
    assert defaults["local_search_rounds"] == 0 and defaults["strategy"] == "foremoe"
    rng = np.random.default_rng(3)
    loads = rng.poisson(np.exp(rng.standard_normal((1, 3, 16))) * 100, size=(2, 3, 16)).astype(np.int64)
    np.save(tmp_path / "l.npy", loads)
    for strategy in ("foremoe", "foremoe-free", "eplb", "static"):
        out = tmp_path / f"{strategy}.json"
        subprocess.run([cli_bin, "plan", "--loads", str(tmp_path / "l.npy"), "--nodes", "2", "--gpus-per-node", "2",
                        "--slots", "5", "--strategy", strategy, "--out", str(out)], check=True, capture_output=True)
        ref = json.loads(out.read_text())
        planner = foremoe.Planner(foremoe.Topology(2, 2, 5), strategy=strategy)
        got = foremoe.plan_document(planner.plan(loads))
        pyout = tmp_path / f"{strategy}_py.json"
        subprocess.run([sys.executable, "-m", "foremoe", "plan", "--loads", str(tmp_path / "l.npy"), "--nodes", "2",
                        "--gpus-per-node", "2", "--slots", "5", "--strategy", strategy, "--out", str(pyout)],
                       check=True, capture_output=True)
        for d in (ref, got):
            d.pop("planner_seconds")
        main = json.loads(pyout.read_text())
        main.pop("planner_seconds")
        assert got == ref == main, strategy


def test_planner_refuses_like_the_cli(cli_bin, tmp_path):
    np.save(tmp_path / "l.npy", np.ones((1, 2, 8), dtype=np.int64))
    for key, flag, value in (("move_budget", "--move-budget", -2), ("threads", "--threads", 0),
                             ("local_search_rounds", "--local-search-rounds", 5000)):
        r = subprocess.run([cli_bin, "plan", "--loads", str(tmp_path / "l.npy"), "--slots", "2", flag, str(value)],
                           capture_output=True, text=True)
        assert r.returncode == 2
        with pytest.raises(ValueError) as e:
            foremoe.Planner(foremoe.Topology(1, 8, 2), **{key: value})
        # Same range and value; the place is named as each front end spells it.
        assert str(e.value).removeprefix(f"Planner.{key}: ") in r.stderr.replace(f"{flag} ", "")


# A tiny synthetic trace (keys of options("synthetic"), the flags of `foremoe trace gen`).
TINY_TRACE = {"layers": 2, "experts": 8, "topk": 2, "steps": 1, "prompts": 4, "responses": 2, "prompt_mean": 16,
              "response_mean": 32, "max_length": 128, "gpus": 2, "microbatch_tokens": 256}


def trace_gen(cli_bin, tmp_path, cfg):
    """`foremoe trace gen` with `cfg` as flags: (rc, message without the program prefix, loads, steps)."""
    flags = {o["key"]: o["flag"] for o in foremoe.options("synthetic")}
    out = tmp_path / "gen.npy"
    for f in (out, tmp_path / "gen.steps.npy"):
        if f.exists():
            f.unlink()
    args = [cli_bin, "trace", "gen", "--loads", str(out)]
    for k, v in cfg.items():
        args += [f"--{flags[k]}", str(v)]
    r = subprocess.run(args, capture_output=True, text=True)
    err = r.stderr.splitlines()[0] if r.returncode else ""
    err = err.removeprefix("foremoe trace gen: ").removeprefix("error: ")
    if r.returncode:
        return r.returncode, err, None, None
    return 0, "", np.load(out), np.load(tmp_path / "gen.steps.npy")


def py_loads(cfg):
    try:
        sl = foremoe.synthetic_loads(**cfg)
        return 0, "", sl["loads"], sl["step_offsets"]
    except ValueError as e:
        return 1, str(e), None, None


def test_simulate_batch_entries_are_the_synthetic_entries():
    syn = {o["key"]: o for o in foremoe.options("synthetic")}
    # batch.workload and batch.cache are simulate's own (which generator, where its loads are kept), not generator
    # options
    batch = [o for o in foremoe.options("simulate")
             if o["key"].startswith("batch.") and o["key"] not in ("batch.workload", "batch.cache")]
    assert len(batch) == 15
    for o in batch:
        s = syn[o["key"].removeprefix("batch.")]
        # simulate counts its steps (the warm-up steps are generated in front): only that help text differs
        drop = ("key", "default", "help") if o["key"] == "batch.steps" else ("key", "default")
        assert {k: v for k, v in o.items() if k not in drop} == {k: v for k, v in s.items() if k not in drop}, o
        if o["key"] == "batch.steps":
            assert "warm-up" in o["help"]


def test_synthetic_keys_match_trace_gen_for_every_key(cli_bin, tmp_path):
    opts = foremoe.options("synthetic")
    assert [o["key"] for o in opts][:3] == ["preset", "seed", "layers"] and len(opts) == 32
    for o in opts:
        # The default is accepted by both, with identical loads and steps.
        ok = {**TINY_TRACE, o["key"]: o["default"]}
        rc_c, err_c, loads_c, steps_c = trace_gen(cli_bin, tmp_path, ok)
        rc_p, err_p, loads_p, steps_p = py_loads(ok)
        assert (rc_c, err_c) == (0, "") and rc_p == 0, (o["key"], err_c, err_p)
        np.testing.assert_array_equal(loads_c, loads_p, err_msg=o["key"])
        np.testing.assert_array_equal(steps_c, steps_p, err_msg=o["key"])
        # A value out of range is refused by both: the same message, the place spelled as each front end does.
        bad = {**TINY_TRACE, o["key"]: bad_value(o)}
        rc_c, err_c, _, _ = trace_gen(cli_bin, tmp_path, bad)
        rc_p, err_p, _, _ = py_loads(bad)
        assert rc_c == 2 and rc_p == 1, (o["key"], err_c, err_p)
        assert err_c.startswith(f"--{o['flag']} must be "), err_c
        assert err_p.startswith(f"synthetic_loads.{o['key']}: must be "), err_p
        assert err_c.removeprefix(f"--{o['flag']} ") == err_p.removeprefix(f"synthetic_loads.{o['key']}: "), o


def test_synthetic_config_refusals_match_trace_gen(cli_bin, tmp_path):
    # Values in range that the generator refuses as a whole: the same message from both.
    for extra in ({"experts": 4, "topk": 5}, {"topics": 2, "topics_per_prompt": 3}, {"prompt_min": 200},
                  {"prompts": 1 << 14, "responses": 1 << 15}):
        cfg = {**TINY_TRACE, **extra}
        rc_c, err_c, _, _ = trace_gen(cli_bin, tmp_path, cfg)
        rc_p, err_p, _, _ = py_loads(cfg)
        # The command line calls a refused flag value a usage error (exit 2); the library raises the same message.
        assert rc_c == 2 and rc_p == 1 and err_c == err_p, (extra, err_c, err_p)
        assert err_p.startswith("SyntheticConfig: "), err_p
    # The preset sets the shape, explicit keys override it; topics caps topics_per_prompt, as on the command line.
    for extra in ({"preset": "deepseek-v3", "layers": 3}, {"topics": 2}, {"max_length": 20}):
        cfg = {**TINY_TRACE, **extra}
        rc_c, err_c, loads_c, _ = trace_gen(cli_bin, tmp_path, cfg)
        rc_p, err_p, loads_p, _ = py_loads(cfg)
        assert rc_c == rc_p == 0, (extra, err_c, err_p)
        np.testing.assert_array_equal(loads_c, loads_p)
    assert loads_p.shape[1:] == (2, 8)
    # Unknown keys are refused naming them and the known keys; so are values of the wrong type.
    with pytest.raises(ValueError) as e:
        foremoe.synthetic_trace(num_layers=4)
    known = ", ".join(o["key"] for o in foremoe.options("synthetic"))
    assert str(e.value) == f"synthetic_trace: unknown key 'num_layers' (known: {known})"
    with pytest.raises(ValueError, match=r"^synthetic_trace.layers: expected an integer, got 2.5$"):
        foremoe.synthetic_trace(layers=2.5)
    with pytest.raises(ValueError, match=r"^synthetic_loads.topk: expected an integer, got true$"):
        foremoe.synthetic_loads(topk=True)


def test_planner_stub_names_every_planner_option():
    """The typed stub's `Planner(...)` keywords are the planner schema's keys (`threads` included), so type
    checkers accept every option the library takes and no option it refuses."""
    import ast
    import pathlib

    stub = pathlib.Path(foremoe.__file__).with_name("__init__.pyi")
    tree = ast.parse(stub.read_text())
    init = next(f for c in tree.body if isinstance(c, ast.ClassDef) and c.name == "Planner"
                for f in c.body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
    names = {a.arg for a in init.args.args + init.args.kwonlyargs} - {"self", "topology"}
    assert names == {o["key"] for o in foremoe.options("planner")}
