"""The host-side logic of CUDA slot storage on the transfer engine (issue 29), testable without a GPU: which builds
may move CUDA rows, the engine options a CUDA storage asks for, the refusals of storages the engine cannot move,
and the small collectives on a group that takes CUDA tensors only. The moves themselves need a GPU
(``test_torch_engine.py``'s ``needs_cuda`` cases)."""

import types

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="skipped: PyTorch (torch) is not installed; foremoe.torch needs it")

import foremoe.torch as ft  # noqa: E402
from foremoe.torch import distributed as fd  # noqa: E402
from foremoe.torch import engine as fe  # noqa: E402
from foremoe.torch import mover  # noqa: E402


def fake_build(monkeypatch, **info):
    monkeypatch.setattr(fe, "runtime_build_info", lambda: info)


def test_cuda_storage_needs_the_cuda_backend_and_nccl_for_several_ranks(monkeypatch):
    fake_build(monkeypatch, cuda_compiled=False, nccl_compiled=False)
    with pytest.raises(ValueError, match="built without.*FOREMOE_PYTHON_CUDA=ON"):
        mover.check_cuda_engine(1)
    fake_build(monkeypatch, cuda_compiled=True, nccl_compiled=False)
    mover.check_cuda_engine(1)  # one rank: nothing to pair, no NCCL needed
    with pytest.raises(ValueError, match="4 ranks exchange CUDA rows .* without NCCL"):
        mover.check_cuda_engine(4)
    fake_build(monkeypatch, cuda_compiled=True, nccl_compiled=True)
    mover.check_cuda_engine(4)


def test_one_build_check_names_what_is_missing(monkeypatch):
    """``engine.cuda_build_gap``: the one check behind both refusals. A group of one rank needs no NCCL to move rows,
    but ``TransferEngine(backend="cuda", group=...)`` makes its communicator anyway, so it does then."""
    fake_build(monkeypatch, cuda_compiled=False, nccl_compiled=True)
    assert "without the runtime's CUDA backend (FOREMOE_PYTHON_CUDA=ON)" in fe.cuda_build_gap(1)
    fake_build(monkeypatch, cuda_compiled=True, nccl_compiled=False)
    assert fe.cuda_build_gap(1) is None
    assert "a group of one rank still exchanges CUDA rows" in fe.cuda_build_gap(1, communicator=True)
    gap = fe.cuda_build_gap(3)
    assert gap.startswith("3 ranks exchange CUDA rows") and "built without NCCL" in gap
    fake_build(monkeypatch, cuda_compiled=True, nccl_compiled=True)
    assert fe.cuda_build_gap(3, communicator=True) is None


def storage_on(device, world=4, rank=2):
    t = types.SimpleNamespace(device=torch.device(device))
    return types.SimpleNamespace(_alloc={"w1": t, "w2": t}, names=("w1", "w2"), world=world, rank=rank)


def test_backend_fields_pick_the_rank_s_one_gpu():
    assert mover.backend_fields(storage_on("cpu")) == {}
    assert mover.backend_fields(storage_on("cuda:3")) == dict(backend="cuda", cuda_device_of_gpu=[-1, -1, 3, -1])
    assert mover.backend_fields(storage_on("cuda:0", world=1, rank=0)) == dict(backend="cuda",
                                                                               cuda_device_of_gpu=[0])


def test_cpu_batches_are_not_gated():
    assert mover._ready_event(torch.zeros(2)) is None


def test_storage_refuses_kinds_the_engine_cannot_move():
    own = [0, 0, 1, 1]
    with pytest.raises(ValueError, match=r"share one dtype .* got \['torch.float32', 'torch.float64'\]"):
        ft.ExpertStorage({"a": torch.zeros(2, 3), "b": torch.zeros(2, 3, dtype=torch.float64)}, own, 3, rank=0, world=2)
    if hasattr(torch, "float8_e4m3fn"):  # a float dtype the engine does not add (torch 2.1 and later)
        with pytest.raises(ValueError, match=r"share one dtype .* got \['torch.float8_e4m3fn'\]"):
            ft.ExpertStorage({"a": torch.zeros(2, 3).to(torch.float8_e4m3fn)}, own, 3, rank=0, world=2)
    with pytest.raises(ValueError, match=r"different devices \(\['cpu', 'meta'\]\)"):
        ft.ExpertStorage({"a": torch.zeros(2, 3), "b": torch.zeros(2, 3, device="meta")}, own, 3, rank=0, world=2)


def test_small_collectives_go_through_cuda_on_an_nccl_only_group(monkeypatch):
    backend = {"value": "nccl"}
    monkeypatch.setattr(fd.dist, "get_backend", lambda group=None: backend["value"])
    assert fd._cuda_only(object())
    for value, cuda_only in (("gloo", False), ("cpu:gloo,cuda:nccl", False), ("nccl", True)):
        backend["value"] = value
        assert fd._cuda_only(object()) == cuda_only, value

    def no_group(group=None):
        raise RuntimeError("Default process group has not been initialized")

    monkeypatch.setattr(fd.dist, "get_backend", no_group)
    assert not fd._cuda_only(None)
    # A group of one gathers nothing, on any backend.
    row = torch.tensor([1, 2, 3])
    assert np.array_equal(fd.gather_rows(row, None, 1.0, "x").numpy(), [[1, 2, 3]])
