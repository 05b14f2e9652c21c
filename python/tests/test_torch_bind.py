"""ExpertStorage.bind_parameters: a trainer's own per-expert parameters become the owner rows (what foremoe.megatron
does with Megatron's SequentialMLP experts), in one process."""

import pytest

torch = pytest.importorskip("torch", reason="skipped: PyTorch (torch) is not installed; foremoe.torch needs it")

import foremoe.torch as ft  # noqa: E402


def _storage_and_params():
    g = torch.Generator().manual_seed(3)
    params = {"w1": [torch.nn.Parameter(torch.randn(4, 3, generator=g, dtype=torch.float64)) for _ in range(2)],
              "w2": [torch.nn.Parameter(torch.randn(3, 4, generator=g, dtype=torch.float64)) for _ in range(2)]}
    st = ft.ExpertStorage({n: torch.zeros((2,) + tuple(ps[0].shape), dtype=torch.float64) for n, ps in params.items()},
                          [0, 0, 1, 1], 3, rank=0, world=2)
    return st, params


def test_bind_aliases_rows_and_tracks_updates():
    st, params = _storage_and_params()
    values = {n: [p.detach().clone() for p in ps] for n, ps in params.items()}
    st.bind_parameters(params)
    for n, ps in params.items():
        for i, p in enumerate(ps):
            assert p.data_ptr() == st.storage[n][i].data_ptr()
            assert torch.equal(st.storage[n][i], values[n][i])  # the parameters' values moved into the rows
    assert not st.owners_changed()
    with torch.no_grad():
        params["w2"][1].mul_(2.0)  # an optimizer's in-place step on one bound parameter
    assert st.owners_changed()
    assert torch.equal(st.storage["w2"][1], 2.0 * values["w2"][1])
    st.check_aliasing()
    params["w1"][0].data = params["w1"][0].data.clone()  # what a distributed optimizer's buffer does
    with pytest.raises(ValueError, match="bound trainer parameter no longer aliases its slot storage row"):
        st.check_aliasing()


def test_bind_bad_input():
    st, params = _storage_and_params()
    with pytest.raises(ValueError, match="no weight kind 'w3'"):
        st.bind_parameters({"w3": params["w1"]})
    with pytest.raises(ValueError, match="1 parameters of 'w1' for the 2 experts rank 0 owns"):
        st.bind_parameters({"w1": params["w1"][:1]})
    with pytest.raises(ValueError, match=r"parameter 0 of 'w1' is \[3, 4\]"):
        st.bind_parameters({"w1": params["w2"]})
    assert all(p.data_ptr() != st.storage["w1"][0].data_ptr() for p in params["w1"])  # nothing bound
