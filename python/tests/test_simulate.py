import json
import subprocess
import sys

import numpy as np
import pytest

import foremoe

CFG = {
    "model": {"layers": 4, "experts": 16, "topk": 2, "hidden": 1024, "expert_ffn": 512},
    "topology": {"nodes": 1, "gpus_per_node": 4, "slots": 6},
    "batch": {"steps": 2, "prompts": 8, "responses": 4, "prompt_mean": 64, "response_mean": 128,
              "microbatch_tokens": 512},
}


def seeded(seed):
    return dict(CFG, batch=dict(CFG["batch"], seed=seed))


def strip(doc):
    for s in doc["strategies"]:
        for k in ("planner_seconds", "planner_critical_seconds", "step_with_planner_seconds"):  # wall time
            s.pop(k)
    doc.get("best_deployment", {}).pop("search_seconds", None)  # wall time
    return doc


def test_simulate_keys_and_values():
    r = foremoe.simulate(seeded(3))
    assert [s["strategy"] for s in r["strategies"]] == list(foremoe.SIM_STRATEGIES)
    assert r["num_layers"] == 4 and r["num_steps"] == 2
    ideal = r["strategies"][-1]
    assert ideal["imbalance_median"] == pytest.approx(1.0)
    assert all(s["step_seconds"] > 0 for s in r["strategies"])


def test_breakdown_fields_are_the_plots_and_add_up():
    """The plot stacks every breakdown field the document writes (none missing, none stale), and they add up to the
    step; the overlap setting moves all-to-all time into a2a_hidden_seconds."""
    from foremoe.plot import BREAKDOWN  # no matplotlib needed to import the table

    r = foremoe.simulate(seeded(3))
    for s in r["strategies"]:
        b = s["breakdown"]
        assert set(b) - {"total_seconds"} == {key for key, _, _ in BREAKDOWN}
        assert b["total_seconds"] == pytest.approx(s["step_seconds"])
        assert sum(b[key] for key, _, _ in BREAKDOWN) == pytest.approx(s["step_seconds"])
        assert s["a2a_hidden_seconds"] == 0
    o = foremoe.simulate(dict(seeded(3), sim={"a2a_overlap": 1.0}))
    for s, t in zip(r["strategies"], o["strategies"]):
        assert t["step_seconds"] <= s["step_seconds"] * (1 + 1e-12)
        assert t["a2a_hidden_seconds"] > 0


def test_per_gpu_loads_and_layer_imbalance():
    """micro_step_gpu_load [micro-step, gpu] of layer gpu_load_layer and micro_step_layer_imbalance [micro-step,
    layer]: the same tokens under every strategy, and each row's max/mean is that layer's imbalance."""
    r = foremoe.simulate(dict(seeded(4), sim={"gpu_load_layer": 2}))
    assert r["gpu_load_layer"] == 2 and r["config"]["sim"]["gpu_load_layer"] == 2
    assert r["axes"]["strategies[].micro_step_gpu_load"] == ["simulated_micro_step", "gpu"]
    assert r["axes"]["strategies[].micro_step_layer_imbalance"] == ["simulated_micro_step", "layer"]
    totals = None
    for s in r["strategies"]:
        loads = np.asarray(s["micro_step_gpu_load"], dtype=float)
        imb = np.asarray(s["micro_step_layer_imbalance"])
        assert loads.shape == (len(s["micro_step_layer_seconds"]), r["ep_size"])
        assert imb.shape == np.asarray(s["micro_step_layer_seconds"]).shape
        totals = loads.sum(axis=1) if totals is None else totals
        np.testing.assert_allclose(loads.sum(axis=1), totals)  # every strategy places the same tokens
        np.testing.assert_allclose(loads.max(axis=1) / loads.mean(axis=1), imb[:, 2], rtol=1e-9)
        assert np.all(imb >= 1 - 1e-12)
        v = np.sort(imb.ravel())  # the table's figures are nearest-rank quantiles of these (one EP group)
        assert v[int(np.ceil(0.5 * v.size)) - 1] == pytest.approx(s["imbalance_median"], rel=1e-12)
        assert v[int(np.ceil(0.99 * v.size)) - 1] == pytest.approx(s["imbalance_p99"], rel=1e-12)
    static = np.asarray(r["strategies"][[s["strategy"] for s in r["strategies"]].index("static")]["micro_step_gpu_load"])
    assert static.std(axis=1).max() > 0  # the synthetic batch is skewed: static is not balanced
    with pytest.raises(ValueError, match="gpu_load_layer 4"):
        foremoe.simulate(dict(seeded(4), sim={"gpu_load_layer": 4}))


def test_simulate_matches_cli(cli, tmp_path):
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(CFG))
    out = tmp_path / "sim.json"
    subprocess.run([cli, "simulate", "--config", str(cfg), "--seed", "3", "--json", str(out)], check=True,
                   capture_output=True)
    ref = strip(json.loads(out.read_text()))
    got = strip(foremoe.simulate(seeded(3)))
    assert set(got) == set(ref)
    assert [set(s) for s in got["strategies"]] == [set(s) for s in ref["strategies"]]
    assert got == ref
    # python -m foremoe simulate writes the same document.
    pyout = tmp_path / "sim_py.json"
    subprocess.run([sys.executable, "-m", "foremoe", "simulate", "--config", str(cfg), "--seed", "3", "--json",
                    str(pyout)], check=True, capture_output=True)
    assert strip(json.loads(pyout.read_text())) == ref


def test_simulate_given_loads_matches_cli(cli, tmp_path):
    sl = foremoe.synthetic_loads(layers=4, experts=16, topk=2, steps=2, prompts=8, responses=4, gpus=4,
                                 microbatch_tokens=512, seed=5)
    np.save(tmp_path / "l.npy", sl["loads"])
    np.save(tmp_path / "l.steps.npy", sl["step_offsets"])
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(CFG))
    out = tmp_path / "sim.json"
    subprocess.run([cli, "simulate", "--config", str(cfg), "--loads", str(tmp_path / "l.npy"), "--strategies",
                    "static,foremoe", "--json", str(out)], check=True, capture_output=True)
    got = foremoe.simulate(CFG, sl["loads"], sl["step_offsets"], "static,foremoe")
    assert strip(got) == strip(json.loads(out.read_text()))


@pytest.mark.parametrize("cfg, match", [
    ({"modle": {}}, "config: unknown key 'modle'"),
    ({"model": {"layers": "4"}}, r'config.model.layers: expected an integer, got "4"'),
    ({"model": {"layers": 4.0}}, r"config.model.layers: expected an integer, got 4.0"),
    ({"topology": {"slots": 1}}, "slots cannot hold all 128 experts"),
    ({"topology": {"slots": 2**32 + 5}}, r"config.topology.slots: must be in \[1, 16384\], got 4294967301"),
    ({"preset": "gpt"}, "config.preset: must be one of qwen3-30b-a3b, deepseek-v3, kimi-k2, got 'gpt'"),
])
def test_bad_config(cfg, match):
    with pytest.raises(ValueError, match=match):
        foremoe.simulate(cfg, strategies=["static"])


def test_bad_strategy_and_loads():
    with pytest.raises(ValueError, match="unknown strategy 'best'"):
        foremoe.simulate(CFG, strategies="best")
    with pytest.raises(ValueError, match="loads are 2 layers x 16 experts, the model has 4 x 16"):
        foremoe.simulate(CFG, np.ones((3, 2, 16), dtype=np.int64), strategies="static")


def test_simulate_config_round_trip():
    full = foremoe.simulate_config(CFG)
    cost_keys = {o["key"].split(".", 1)[1] for o in foremoe.options("simulate") if o["key"].startswith("cost.")}
    assert full["model"]["layers"] == 4 and set(full["cost"]) == cost_keys
    assert full["cost"]["a2a_model"] == "hierarchical"
    assert foremoe.simulate_config(full) == full
    assert strip(foremoe.simulate(full, strategies="static,foremoe")) == strip(
        foremoe.simulate(CFG, strategies="static,foremoe"))


def test_load_cache_gives_the_same_results(tmp_path, monkeypatch):
    """batch.cache: the second run of a batch reads the loads the first generated (one entry per batch), with the
    same results; "off" writes nothing; an empty setting is refused by the schema."""
    cache = tmp_path / "cache"
    cfg = dict(seeded(5), batch=dict(seeded(5)["batch"], cache=str(cache)))
    first = strip(foremoe.simulate(cfg))
    entries = sorted(cache.glob("loads-*.bin"))
    assert len(entries) == 1
    assert strip(foremoe.simulate(cfg)) == first
    foremoe.simulate(cfg, strategies="static,foremoe")  # other strategies: the same batch, the same entry
    assert sorted(cache.glob("loads-*.bin")) == entries
    # The entry is what is read: a run that finds its bytes damaged generates again and rewrites it.
    entries[0].write_bytes(entries[0].read_bytes()[:-1] + b"x")
    assert strip(foremoe.simulate(cfg)) == first
    foremoe.simulate(dict(cfg, batch=dict(cfg["batch"], seed=6)), strategies="static")
    assert len(list(cache.glob("loads-*.bin"))) == 2
    env = tmp_path / "env"
    monkeypatch.setenv("FOREMOE_CACHE_DIR", str(env))
    foremoe.simulate(dict(cfg, batch=dict(cfg["batch"], cache="off")), strategies="static")
    assert not env.exists()
    foremoe.simulate(dict(cfg, batch=dict(cfg["batch"], cache="auto")), strategies="static")
    assert len(list(env.glob("loads-*.bin"))) == 1
    with pytest.raises(ValueError, match="batch.cache: must be auto, off or a directory, got an empty string"):
        foremoe.simulate(dict(cfg, batch=dict(cfg["batch"], cache="")))


def test_default_batch_is_built_in(tmp_path):
    """The default batch's loads are built into the extension as into the program: the main job unpacks them instead
    of generating them, writes no cache entry, and simulate() gives the same document."""
    cache, out = tmp_path / "cache", tmp_path / "doc.json"
    # (the configured deployment alone: the deployment search's batch, counted by source, is not built in)
    r = subprocess.run([sys.executable, "-m", "foremoe", "simulate", "--strategies", "static", "--cache", str(cache),
                        "--no-best-deployment", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "loads of the default batch built into the program" in r.stderr
    doc = foremoe.simulate({"batch": {"cache": str(cache)}, "search": {"best_deployment": False}}, strategies="static")
    assert strip(doc) == strip(json.loads(out.read_text()))
    assert not cache.exists()


def test_best_deployment_is_never_slower_than_the_configured_one():
    """Each strategy's best deployment is its fastest fitting run of the search, the configured deployment among
    them, so it is never slower than the configured deployment's figure; off, the document has no search."""
    for seed in (3, 4):
        doc = foremoe.simulate(seeded(seed))
        best = {b["strategy"]: b for b in doc["best_deployment"]["strategies"]}
        runs = doc["best_deployment"]["runs"]
        assert {c["ep_size"] for c in doc["best_deployment"]["candidates"]} >= {doc["ep_size"]}
        for s in doc["strategies"]:
            b = best[s["strategy"]]
            assert b["fits"] and b["step_seconds"] <= s["step_seconds"]
            fastest = min(r["step_seconds"] for r in runs if r["strategy"] == s["strategy"] and r["fits"])
            assert b["step_seconds"] == fastest
    off = foremoe.simulate(dict(seeded(3), search={"best_deployment": False}))
    assert "best_deployment" not in off
