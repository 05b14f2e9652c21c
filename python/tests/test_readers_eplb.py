"""trace readers (verl, SGLang), count_loads(mask=), rebalance_experts (the EPLB contract) and placement export."""

import base64
import json

import numpy as np
import pytest

import foremoe
from foremoe import Planner, Topology
from foremoe import eplb as _eplb

import test_eplb_split as _split  # EPLB's output contract, checked in one place


def _count_ref(ids, keep, E):
    L = ids.shape[1]
    return np.stack([np.bincount(ids[keep, l].ravel()[ids[keep, l].ravel() >= 0], minlength=E) for l in range(L)])


@pytest.mark.parametrize("seed", range(8))
def test_mask_equals_count_over_unmasked_subset(seed):
    rng = np.random.default_rng(seed)
    T, L, K, E = int(rng.integers(0, 300)), int(rng.integers(1, 5)), int(rng.integers(1, 4)), 24
    ids = rng.integers(-1, E, size=(T, L, K)).astype(np.int16)
    mask = rng.random(T) < rng.random()
    out = foremoe.count_loads(ids, num_experts=E, mask=mask)
    np.testing.assert_array_equal(out[0], _count_ref(ids, mask, E))
    np.testing.assert_array_equal(out, foremoe.count_loads(ids[mask], num_experts=E))
    # integer masks: any nonzero keeps the token
    np.testing.assert_array_equal(foremoe.count_loads(ids, num_experts=E, mask=mask.astype(np.int32) * 7), out)


def test_mask_wrong_length_and_dtype():
    ids = np.zeros((5, 1, 2), np.int32)
    with pytest.raises(ValueError, match="mask has 4 entries but the trace has 5 tokens"):
        foremoe.count_loads(ids, num_experts=2, mask=np.ones(4, bool))
    with pytest.raises(ValueError, match="mask must be bool or integer"):
        foremoe.count_loads(ids, num_experts=2, mask=np.ones(5))


def _verl(seed):
    rng = np.random.default_rng(seed)
    bs, seq, L, K, E = 3, 7, 2, 2, 8
    ids = rng.integers(0, E, size=(bs, seq, L, K)).astype(np.int32)
    mask = np.ones((bs, seq), bool)
    for b in range(bs):  # left padding, zeros in the ids as verl has them
        pad = int(rng.integers(0, seq))
        mask[b, :pad] = False
        ids[b, :pad] = 0
    return ids, mask, E


def test_read_verl_left_padding_not_counted(tmp_path):
    ids, mask, E = _verl(3)
    flat, m = foremoe.read_verl(ids, mask)
    assert flat.shape == (ids.shape[0] * ids.shape[1], 2, 2) and m.dtype == np.uint8
    want = np.stack([np.bincount(ids[..., l, :][mask].ravel(), minlength=E) for l in range(2)])
    np.testing.assert_array_equal(foremoe.count_loads(flat, num_experts=E, mask=m)[0], want)
    # the 4-D form straight into count_loads, and from files
    np.testing.assert_array_equal(foremoe.count_loads(ids, num_experts=E, mask=mask)[0], want)
    np.save(tmp_path / "ids.npy", ids)
    np.save(tmp_path / "mask.npy", mask)
    f, fm = foremoe.read_verl(tmp_path / "ids.npy", tmp_path / "mask.npy")
    np.testing.assert_array_equal(foremoe.count_loads(f, num_experts=E, mask=fm)[0], want)
    # without the mask, padding is counted as expert 0: the bug the mask fixes
    assert foremoe.count_loads(flat, num_experts=E)[0][:, 0].sum() > want[:, 0].sum()
    with pytest.raises(ValueError, match="attention_mask: attention mask must be"):
        foremoe.read_verl(ids, mask[:, :3])


def test_read_verl_cli_agrees(tmp_path, cli):
    import subprocess

    ids, mask, E = _verl(5)
    np.save(tmp_path / "ids.npy", ids)
    np.save(tmp_path / "mask.npy", mask)  # NumPy bool mask
    subprocess.run([cli, "trace", "count", str(tmp_path / "ids.npy"), "--mask", str(tmp_path / "mask.npy"),
                    "--experts", str(E), "--out", str(tmp_path / "c.npy")], check=True, capture_output=True)
    flat, m = foremoe.read_verl(ids, mask)
    np.testing.assert_array_equal(np.load(tmp_path / "c.npy"), foremoe.count_loads(flat, num_experts=E, mask=m))


def test_read_sglang_roundtrip(tmp_path):
    rng = np.random.default_rng(2)
    L, K, E = 3, 2, 10
    reqs = [rng.integers(0, E, size=(int(n), L, K)).astype("<i4") for n in (4, 0, 9)]
    lines = [json.dumps({"text": "x", "meta_info": {"routed_experts": base64.b64encode(r.tobytes()).decode()}})
             for r in reqs[:2]] + [json.dumps({"routed_experts": base64.b64encode(reqs[2].tobytes()).decode()})]
    (tmp_path / "r.jsonl").write_text("\n".join(lines) + "\n\n")
    ids, offs = foremoe.read_sglang(tmp_path / "r.jsonl", L, K)
    np.testing.assert_array_equal(ids, np.concatenate(reqs))
    np.testing.assert_array_equal(offs, [0, 4, 4, 13])
    out = foremoe.count_loads(ids, offs, num_experts=E)
    assert out.shape == (3, L, E) and out[1].sum() == 0
    # dicts and bare base64 strings
    ids2, _ = foremoe.read_sglang([json.loads(s) for s in lines], L, K)
    np.testing.assert_array_equal(ids2, ids)


@pytest.mark.parametrize("payload, msg", [("AAAA*AAA", "malformed base64"), ("AAAAA", "malformed base64"),
                                           (base64.b64encode(b"\0" * 12).decode(), "not a whole number")])
def test_read_sglang_malformed(payload, msg):
    with pytest.raises(ValueError, match=msg):
        foremoe.read_sglang([json.dumps({"routed_experts": payload})], 2, 2)
    with pytest.raises(ValueError, match="no routed_experts"):
        foremoe.read_sglang(['{"meta_info": {}}'], 2, 2)


def test_trace_formats_registry_is_the_count_schemas_choice_list():
    names = [f["name"] for f in foremoe.trace_formats()]
    assert tuple(names) == foremoe.TRACE_FORMATS and {"npy", "verl", "sglang", "megatron"} <= set(names)
    fmt = next(o for o in foremoe.options("count") if o["key"] == "format")
    assert fmt["choices"] == ["auto", *names]
    with pytest.raises(ValueError, match="unknown trace format 'parquet'"):
        foremoe.read_trace("x.parquet", "parquet")


def _write_every_format(tmp_path, ids):
    """`ids` [T, L, K] written in every built-in format: (path, format, read_trace keywords) each."""
    T, L, K = ids.shape
    np.save(tmp_path / "ids.npy", ids)
    np.save(tmp_path / "mg.npy", np.ascontiguousarray(ids.transpose(1, 0, 2)))
    half = T // 2  # verl: two rows of `half` tokens each, left-padded by one position holding expert 0
    pad = np.zeros((1, L, K), ids.dtype)
    np.save(tmp_path / "verl.npy", np.stack([np.concatenate([pad, ids[:half]]), np.concatenate([pad, ids[half:]])]))
    np.save(tmp_path / "verl_mask.npy", np.stack([np.arange(half + 1) > 0] * 2))
    lines = [json.dumps({"routed_experts": base64.b64encode(p.astype("<i4").tobytes()).decode()})
             for p in (ids[:half], ids[half:])]
    (tmp_path / "r.jsonl").write_text("\n".join(lines) + "\n")
    return [(tmp_path / "ids.npy", "auto", {}), (tmp_path / "mg.npy", "megatron", {}),
            (tmp_path / "verl.npy", "auto", {"mask": tmp_path / "verl_mask.npy"}),
            (tmp_path / "r.jsonl", "auto", {"num_layers": L, "topk": K})]


@pytest.mark.parametrize("seed", range(3))
def test_every_format_reads_through_the_registry_as_trace_count_does(tmp_path, cli, seed):
    import subprocess

    rng = np.random.default_rng(seed)
    E = 9
    ids = rng.integers(0, E, size=(2 * int(rng.integers(1, 6)), int(rng.integers(1, 4)), 2)).astype(np.int32)
    want = foremoe.count_loads(ids, num_experts=E)
    for path, fmt, kw in _write_every_format(tmp_path, ids):
        rec = foremoe.read_trace(path, fmt, **kw)
        assert rec.format in foremoe.TRACE_FORMATS and (fmt == "auto" or rec.format == fmt)
        np.testing.assert_array_equal(foremoe.count_loads(rec.ids, num_experts=E, mask=rec.mask), want)
        np.testing.assert_array_equal(foremoe.count_loads(path, num_experts=E, format=fmt, **kw), want)
        args = [cli, "trace", "count", str(path), "--format", fmt, "--experts", str(E), "--out", str(tmp_path / "c.npy")]
        if "mask" in kw:
            args += ["--mask", str(kw["mask"])]
        if "num_layers" in kw:
            args += ["--layers", str(kw["num_layers"]), "--topk", str(kw["topk"])]
        subprocess.run(args, check=True, capture_output=True)
        np.testing.assert_array_equal(np.load(tmp_path / "c.npy"), want)
    with pytest.raises(ValueError, match="verl.npy is read as npy"):
        foremoe.read_trace(tmp_path / "verl.npy", "npy", mask=tmp_path / "verl_mask.npy")
    with pytest.raises(ValueError, match="verl_mask.npy"):
        foremoe.read_trace(tmp_path / "verl_mask.npy", "npy")


@pytest.mark.parametrize("seed", range(12))
def test_rebalance_experts_exact_split_contract_and_never_worse_than_eplb(seed):
    rng = np.random.default_rng(100 + seed)
    N = int(rng.choice([1, 2]))
    G = N * int(rng.choice([2, 4]))
    E = G * int(rng.integers(1, 5))
    R = G * int(rng.integers(max(1, E // G), E // G + 4))
    L = int(rng.integers(1, 5))
    groups = int(rng.choice([d for d in (1, 2, 4) if E % d == 0]))
    w = rng.gamma(0.3 + rng.random(), 50.0, size=(L, E))
    out = foremoe.rebalance_experts(w, R, groups, N, G, split="exact")
    assert all(isinstance(a, np.ndarray) and a.dtype == np.int64 for a in out)
    _split.check_contract(w, R, G, out)
    # balance: the returned placement, planned again from this resident with the same loads, peaks no higher
    # than our EPLB re-implementation's plan for the same input (peak GPU load per layer).
    loads = _eplb._integral(w)
    topo = Topology(N, G // N, R // G)
    ours = Planner(topo, strategy="foremoe-free", free_search_rounds=0, move_budget=0).plan(
        loads, resident=out[0].reshape(L, G, R // G))
    np.testing.assert_array_equal(np.asarray(ours.phys_to_log), out[0])  # the placement is kept, only re-split
    theirs = Planner(topo, strategy="eplb", eplb_num_groups=groups).plan(loads, previous_loads=loads)
    assert (np.asarray(ours.max_gpu_load) <= np.asarray(theirs.max_gpu_load)).all()


@pytest.mark.parametrize("split", ["even", "exact"])
def test_rebalance_experts_integer_and_list_input_and_errors(split):
    w = [[5, 1, 1, 1], [0, 0, 0, 9]]
    out = foremoe.rebalance_experts(w, 8, 1, 1, 2, split=split)
    _split.check_contract(np.asarray(w), 8, 2, out)
    with pytest.raises(ValueError, match="not a multiple of num_gpus"):
        foremoe.rebalance_experts(w, 7, 1, 1, 2)
    with pytest.raises(ValueError, match="fewer than the 4 experts"):
        foremoe.rebalance_experts(w, 2, 1, 1, 2)
    with pytest.raises(ValueError, match="slots per GPU exceed"):
        foremoe.rebalance_experts(w, 10, 1, 1, 1)
    with pytest.raises(ValueError, match="not a finite non-negative"):
        foremoe.rebalance_experts(np.array([[1.0, np.nan, 0, 0]]), 4, 1, 1, 2, split=split)
    with pytest.raises(ValueError, match=r"weight\[0, 1\] = -1 is not a finite non-negative"):
        foremoe.rebalance_experts([[1, -1, 0, 0]], 4, 1, 1, 2, split=split)


def test_rebalance_experts_torch_in_torch_out():
    torch = pytest.importorskip("torch")
    w = torch.rand(3, 8, dtype=torch.float32) * 100
    out = foremoe.rebalance_experts(w, 12, 2, 1, 4)
    assert all(isinstance(a, torch.Tensor) and a.dtype == torch.int64 for a in out)
    _split.check_contract(w.numpy(), 12, 4, tuple(a.numpy() for a in out))


def test_export_placement_formats(tmp_path):
    w = np.random.default_rng(0).random((2, 8)) * 10
    phy2log, log2phy, logcnt = foremoe.rebalance_experts(w, 12, 1, 1, 4)
    foremoe.export_placement(phy2log, tmp_path / "s.json", "sglang")
    assert json.loads((tmp_path / "s.json").read_text()) == {"physical_to_logical_map": phy2log.tolist()}
    foremoe.export_placement(phy2log, tmp_path / "v.json", "vllm", num_experts=8)
    v = json.loads((tmp_path / "v.json").read_text())
    assert v["physical_to_logical_map"] == phy2log.tolist()
    assert v["logical_replica_count"] == logcnt.tolist()
    assert v["logical_to_physical_map"] == log2phy.tolist()
    with pytest.raises(ValueError, match="format must be sglang or vllm"):
        foremoe.export_placement(phy2log, tmp_path / "x.json", "nope")
    bad = phy2log.copy()
    bad[1, 3] = -1
    with pytest.raises(ValueError, match="physical slot 3 of layer 1 is empty"):
        foremoe.export_placement(bad, tmp_path / "x.json")


def test_count_options_schema():
    keys = {o["key"] for o in foremoe.options("count")}
    assert {"format", "experts", "dense_layers", "microbatch_tokens", "by_source", "sources"} <= keys
