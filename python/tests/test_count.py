import numpy as np
import pytest

import foremoe
from foremoe import _core

DTYPES = [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.int64]


def ids_and_reference(seed=0, T=600, L=3, K=4, E=20):
    rng = np.random.default_rng(seed)
    ids = rng.integers(-1, E, size=(T, L, K)).astype(np.int64)
    offs = np.array([0, 100, 100, 350, T])
    ref = np.zeros((len(offs) - 1, L, E), dtype=np.int64)
    for m in range(len(offs) - 1):
        for l in range(L):
            v = ids[offs[m]:offs[m + 1], l].ravel()
            ref[m, l] = np.bincount(v[v >= 0], minlength=E)
    return ids, offs, ref, E


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype(dtype):
    ids, offs, ref, E = ids_and_reference()
    x = ids.astype(dtype)  # -1 becomes all-ones for unsigned dtypes: still "no route"
    out = foremoe.count_loads(x, offs, num_experts=E)
    assert out.dtype == np.int64 and out.shape == ref.shape
    np.testing.assert_array_equal(out, ref)


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_zero_copy_contiguous(dtype):
    ids, _, _, _ = ids_and_reference()
    x = np.ascontiguousarray(ids.astype(dtype))
    assert _core._data_address(x) == x.ctypes.data


def test_strided_views_are_read_in_place():
    ids, offs, ref, E = ids_and_reference()
    big = np.zeros((ids.shape[0] * 2, ids.shape[1], ids.shape[2] * 2), dtype=np.int32) - 1
    big[::2, :, ::2] = ids
    view = big[::2, :, ::2]
    assert not view.flags.c_contiguous
    assert _core._data_address(view) == view.ctypes.data
    np.testing.assert_array_equal(foremoe.count_loads(view, offs, num_experts=E), ref)
    # Reversed tokens (negative strides) and a transposed copy.
    rev = ids[::-1].astype(np.int16)
    np.testing.assert_array_equal(foremoe.count_loads(rev, num_experts=E)[0], ref.sum(axis=0))
    tr = np.asfortranarray(ids.astype(np.int32))
    np.testing.assert_array_equal(foremoe.count_loads(tr, num_experts=E)[0], ref.sum(axis=0))


def test_read_only_and_lists():
    ids, offs, ref, E = ids_and_reference()
    ro = ids.astype(np.int32)
    ro.setflags(write=False)
    np.testing.assert_array_equal(foremoe.count_loads(ro, offs.tolist(), num_experts=E), ref)
    np.testing.assert_array_equal(foremoe.count_loads(ids.tolist(), num_experts=E)[0], ref.sum(axis=0))


def test_layer_map_and_sources():
    ids, offs, ref, E = ids_and_reference()
    out = foremoe.count_loads(ids, offs, num_experts=E, layer_map=[0, -1, 1])
    np.testing.assert_array_equal(out, ref[:, [0, 2]])
    tot, src = foremoe.count_loads(ids, offs, num_experts=E, num_sources=2, return_by_source=True)
    assert src.shape == ref.shape + (2,)
    np.testing.assert_array_equal(src.sum(axis=-1), tot)
    np.testing.assert_array_equal(tot, ref)


def test_output_owns_memory():
    ids, offs, ref, E = ids_and_reference()
    out = foremoe.count_loads(ids, offs, num_experts=E)
    del ids
    out2 = out.copy()
    out += 0
    np.testing.assert_array_equal(out, out2)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_experts=5), r"expert id \d+ at token \d+, layer \d+, k \d+ is outside \[0, 5\)"),
        (dict(num_experts=0), "num_experts must be positive"),
        (dict(num_experts=20, microbatch_offsets=[0, 10]), "microbatch_offsets end at 10 but the trace has 600"),
        (dict(num_experts=20, microbatch_offsets=[0, 300, 200, 600]), "microbatch_offsets decrease at index 2"),
        (dict(num_experts=20, layer_map=[0, 1]), "layer map covers 2 trace layers but the trace has 3"),
    ],
)
def test_bad_input_raises_value_error(kwargs, match):
    ids, _, _, _ = ids_and_reference()
    mb = kwargs.pop("microbatch_offsets", None)
    with pytest.raises(ValueError, match=match):
        foremoe.count_loads(ids, mb, **kwargs)


@pytest.mark.parametrize("bad, match", [
    (np.zeros((4, 2, 2), dtype=np.float32), "must be int8, uint8, int16, uint16, int32 or int64, got float32"),
    (np.zeros((4, 2, 2), dtype=np.uint32), "got uint32"),
    (np.zeros((4, 2), dtype=np.int32), "must be 3-D"),
    (np.zeros((4, 2, 2), dtype=bool), "bool"),
])
def test_bad_arrays(bad, match):
    with pytest.raises(ValueError, match=match):
        foremoe.count_loads(bad, num_experts=4)


def test_torch_tensors_zero_copy():
    torch = pytest.importorskip("torch")
    ids, offs, ref, E = ids_and_reference()
    t = torch.from_numpy(ids.astype(np.int32))
    assert _core._data_address(t) == t.data_ptr()
    np.testing.assert_array_equal(foremoe.count_loads(t, offs, num_experts=E), ref)


def test_synthetic_trace_counts_match_synthetic_loads():
    cfg = dict(layers=3, experts=16, topk=2, steps=2, prompts=4, responses=2, prompt_mean=32, prompt_sigma=0.3,
               prompt_min=4, response_mean=48, response_sigma=0.3, response_min=4, max_length=128, gpus=4,
               microbatch_tokens=64, seed=7)
    tr = foremoe.synthetic_trace(**cfg)
    assert tr["routed_ids"].dtype == np.int16 and tr["routed_ids"].shape[1:] == (3, 2)
    loads = foremoe.count_loads(tr["routed_ids"], tr["microbatch_offsets"], num_experts=tr["num_experts"])
    sl = foremoe.synthetic_loads(**cfg)
    np.testing.assert_array_equal(loads, sl["loads"])
    np.testing.assert_array_equal(tr["step_offsets"], sl["step_offsets"])
    tot, src = foremoe.count_loads(tr["routed_ids"], tr["microbatch_offsets"], num_experts=16,
                                   num_sources=tr["num_sources"], source_offsets=tr["source_offsets"],
                                   return_by_source=True)
    np.testing.assert_array_equal(src, foremoe.synthetic_loads(by_source=True, **cfg)["loads_by_source"])
    with pytest.raises(ValueError, match="synthetic_trace: unknown key 'num_experts'"):
        foremoe.synthetic_trace(num_experts=3)
    with pytest.raises(ValueError, match="topk 40 exceeds num_experts 16"):
        foremoe.synthetic_trace(experts=16, topk=40)


def test_in_memory_formats_registry_counts_numpy_arrays():
    # The C++ in-memory formats (foremoe.torch's loads_from_verl/megatron/slime) need no torch: NumPy arrays in place.
    assert [f["name"] for f in _core.batch_formats()] == ["megatron", "slime", "verl"]
    ids, offs, ref, E = ids_and_reference()
    per_layer = [ids[:, l, :2] for l in range(ids.shape[1])]  # strided views
    want = foremoe.count_loads(np.ascontiguousarray(ids[:, :, :2]), offs, num_experts=E)
    loads, parts, M, L = _core.count_batch("megatron", "w", per_layer, None, None, None, offs, E, None)
    assert parts is None and (M, L) == (len(offs) - 1, ids.shape[1])
    np.testing.assert_array_equal(loads, want)
    # verl: rows as samples, a strided (every other column) mask of 0/1
    routed = ids[:600].reshape(20, 30, *ids.shape[1:])
    mask = np.ones((20, 60), np.uint8)[:, ::2]
    loads, _, _, _ = _core.count_batch("verl", "w", [routed], None, mask, [np.arange(10), np.arange(10, 20)], None, E,
                                       None)
    np.testing.assert_array_equal(loads, foremoe.count_loads(ids, [0, 300, 600], num_experts=E))
    mask[3, 5] = 7
    with pytest.raises(ValueError, match=r"^w: attention_mask\[3, 5\] = 7 is not 0 or 1"):
        _core.count_batch("verl", "w", [routed], None, mask, None, None, E, None)
    with pytest.raises(ValueError, match=r"^w: sample 4 is in micro-batch 0 and micro-batch 1$"):
        _core.count_batch("verl", "w", [routed], None, mask, [np.arange(5), np.arange(4, 20)], None, E, None)
    with pytest.raises(ValueError, match="unknown in-memory trace format 'nemo'"):
        _core.count_batch("nemo", "w", [routed], None, None, None, None, E, None)


def test_synthetic_packing_keeps_each_step_and_evens_its_micro_steps():
    # The generator's packing option (one schema entry) reaches Python: the same micro-steps and step totals, loads
    # that are the ids' counts, and routing-aware micro-steps no further from the step's share than the trainer's.
    cfg = dict(layers=3, experts=16, topk=2, steps=2, prompts=8, responses=4, prompt_mean=32, response_mean=48,
               max_length=128, gpus=4, microbatch_tokens=256, seed=11, skew=1.0)
    base = foremoe.synthetic_loads(**cfg)

    def deviation(loads, steps):
        total = 0.0
        for a, b in zip(steps[:-1], steps[1:]):
            part = loads[a:b].astype(np.float64)
            total += float(((part - part.mean(axis=0)) ** 2).sum())
        return total

    for packing in ("tokens", "routing"):
        sl = foremoe.synthetic_loads(packing=packing, **cfg)
        np.testing.assert_array_equal(sl["step_offsets"], base["step_offsets"])
        for a, b in zip(base["step_offsets"][:-1], base["step_offsets"][1:]):
            np.testing.assert_array_equal(sl["loads"][a:b].sum(axis=0), base["loads"][a:b].sum(axis=0))
        tr = foremoe.synthetic_trace(packing=packing, **cfg)
        np.testing.assert_array_equal(
            foremoe.count_loads(tr["routed_ids"], tr["microbatch_offsets"], num_experts=16), sl["loads"])
    routed = foremoe.synthetic_loads(packing="routing", **cfg)
    assert deviation(routed["loads"], routed["step_offsets"]) < deviation(base["loads"], base["step_offsets"])
    with pytest.raises(ValueError, match="synthetic_loads.packing: must be one of none, tokens, routing, got 'best'"):
        foremoe.synthetic_loads(packing="best", **cfg)
    with pytest.raises(ValueError, match="packing_ranks 3 must be 0 .all ranks. or divide num_gpus 4"):
        foremoe.synthetic_loads(packing="routing", packing_ranks=3, **cfg)
