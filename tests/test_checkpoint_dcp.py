"""Sharded checkpoints (torch.distributed.checkpoint) on CPU gloo, localhost: save on N ranks,
load on M, and into a non-distributed model, bit for bit; quantized inference weights (row
shards as DTensors, the form FSDP2 holds them in) and an FSDP2 training run (master weights +
Adam state); a save interrupted between its renames (a rank killed while writing:
tests/test_checkpoint_fsdp.py)."""

import datetime
import os

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.utils._pytree import tree_map

from qtensor.checkpoint import CheckpointError
from qtensor.checkpoint import dcp as qdcp
from qtensor.tensors import QuantizedTensor
from qtensor.testing.launch import run_local

NAMES = ["nvfp4_4o6_b256", "nvfp4_dyn_rowscaled", "nvfp4_2d", "mxfp8", "hybrid"]


def _models(seed):
    from test_checkpoint_state_dict import make_model

    return {name: make_model(name, seed) for name in NAMES}


def _shard(t, mesh):
    """A row shard of t as a DTensor (torch.chunk sizes, as FSDP2 shards dim 0); t itself
    (replicated on every rank) when its blocks cannot be split there."""
    world, rank = mesh.size(), mesh.get_local_rank()
    rows = -(-t.shape[0] // world)
    try:
        local = t[rank * rows: (rank + 1) * rows]
    except ValueError:
        return t  # e.g. MXFP8 32x1 blocks of a 32-row weight split over 2 ranks
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=t.shape,
                              stride=t.stride())


def _quantized_state(seed, mesh):
    sd = {}
    for name, model in _models(seed).items():
        for k, v in model.state_dict().items():
            sd[f"{name}.{k}"] = _shard(v, mesh) if mesh is not None else v
    return sd


def _bytes(t):
    t = t._local_tensor if isinstance(t, DTensor) else t
    if isinstance(t, QuantizedTensor):
        return [b for n in t.tensor_data_names if getattr(t, n) is not None
                for b in _bytes(getattr(t, n))]
    return [t.detach().contiguous().reshape(-1).view(torch.uint8)]


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(_bytes(a), _bytes(b), strict=True))


# ---- training: FSDP2 master weights + Adam ----------------------------------------------------


def _train_model(mesh):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    if mesh is not None:
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _step(model, opt, seed):
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(seed))
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _train_state(model, opt):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def _full(model, opt):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(model, opt, options=opts)
    # On CPU the "offloaded" full tensors can alias the live parameters: snapshot them.
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, (msd, osd))


# ---- workers --------------------------------------------------------------------------------


def _worker(rank, world, tmp, task):
    from torch.distributed.device_mesh import init_device_mesh

    task(rank, world, init_device_mesh("cpu", (world,)), tmp)


def _save(rank, world, mesh, tmp):
    qdcp.save(_quantized_state(0, mesh), os.path.join(tmp, f"q{world}"))
    model, opt = _train_model(mesh)
    _step(model, opt, 1)
    qdcp.save(_train_state(model, opt), os.path.join(tmp, f"t{world}"))
    msd, osd = _full(model, opt)
    _step(model, opt, 2)  # the step a resumed run must reproduce
    after, _ = _full(model, opt)
    if rank == 0:
        torch.save({"model": msd, "optim": osd, "after": after},
                   os.path.join(tmp, f"ref{world}.pt"))


def _load(rank, world, mesh, tmp):
    from torch.distributed.checkpoint.state_dict import set_state_dict

    for src in (1, 2):
        sd = _quantized_state(1, mesh)
        qdcp.load(sd, os.path.join(tmp, f"q{src}"))
        want = _quantized_state(0, mesh)
        bad = [k for k in sd if not _same(sd[k], want[k])]
        assert not bad, (src, world, bad)
        model, opt = _train_model(mesh)
        state = _train_state(model, opt)
        qdcp.load(state, os.path.join(tmp, f"t{src}"))
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        _check_training(model, opt, torch.load(os.path.join(tmp, f"ref{src}.pt")))


def _check_training(model, opt, ref):
    """Master weights and Adam state equal the saved run's, and so does the next step. The
    full state dicts exist on rank 0 only (full_state_dict + cpu_offload); the steps are
    collective, so every rank runs them."""
    msd, osd = _full(model, opt)
    assert not msd or set(msd) == set(ref["model"])
    assert all(torch.equal(msd[k], ref["model"][k]) for k in msd)
    for fqn, st in osd.get("state", {}).items():
        for name, v in st.items():
            assert torch.equal(v, ref["optim"]["state"][fqn][name]), (fqn, name)
    _step(model, opt, 2)
    after, _ = _full(model, opt)
    assert all(torch.equal(after[k], ref["after"][k]) for k in after)


def _run(world, tmp, task):
    timeout = datetime.timedelta(seconds=60)
    run_local(_worker, world, str(tmp), task, timeout=timeout)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dcp")
    _run(1, tmp, _save)
    _run(2, tmp, _save)
    return tmp


def test_load_on_two_ranks(saved):
    _run(2, saved, _load)  # 1 -> 2 and 2 -> 2


def test_load_on_one_rank(saved):
    _run(1, saved, _load)  # 2 -> 1 (and 1 -> 1)


def test_load_into_non_distributed_model(saved):
    for src in (1, 2):
        sd = _quantized_state(1, None)
        qdcp.load(sd, saved / f"q{src}")
        want = _quantized_state(0, None)
        assert all(_same(sd[k], want[k]) for k in sd)
        models = _models(1)
        for name, model in models.items():
            model.load_state_dict({k.split(".", 1)[1]: v for k, v in sd.items()
                                   if k.startswith(name + ".")})
        # outputs of the loaded models equal the saved ones bit for bit
        from test_checkpoint_state_dict import inputs

        with torch.no_grad():
            for name, ref in _models(0).items():
                assert torch.equal(models[name](inputs()), ref(inputs())), name
        model, opt = _train_model(None)
        state = _train_state(model, opt)
        qdcp.load(state, saved / f"t{src}")
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        _check_training(model, opt, torch.load(saved / f"ref{src}.pt"))


def test_metadata_mismatch_is_refused_before_loading(saved):
    sd = _quantized_state(1, None)
    sd["nvfp4_2d.0.weight"], sd["nvfp4_4o6_b256.0.weight"] = (
        sd["nvfp4_4o6_b256.0.weight"], sd["nvfp4_2d.0.weight"])
    before = [b.clone() for v in sd.values() for b in _bytes(v)]
    with pytest.raises(CheckpointError, match="'nvfp4_4o6_b256.0.weight'.*block_2d: True != False.*e4m3_bound: 448 != 256"):
        qdcp.load(sd, saved / "q2")
    assert all(torch.equal(a, b) for a, b in zip(before, [b for v in sd.values() for b in _bytes(v)]))


def _save_killed_between_renames(path, monkeypatch):
    """Save `first`, then a second checkpoint whose rank 0 dies after moving the previous one
    aside and before renaming the new one into place; returns (first, second)."""
    first, second = _quantized_state(0, None), _quantized_state(1, None)
    qdcp.save(first, path)
    rename = os.replace

    def dies_after_moving_aside(src, dst):
        rename(src, dst)
        if os.fspath(dst).endswith(".old"):
            raise SystemExit("rank 0 killed")  # nothing after this line of save runs

    monkeypatch.setattr(os, "replace", dies_after_moving_aside)
    with pytest.raises(SystemExit):
        qdcp.save(second, path)
    monkeypatch.undo()
    return first, second


def test_save_after_a_killed_rename_keeps_the_newest_checkpoint(tmp_path, monkeypatch):
    """After rank 0 died between the two renames (PATH missing, PATH.incomplete the newest
    complete checkpoint), the next save first finishes that rename: if it then dies while
    writing, `load(PATH)` still reads the newest complete checkpoint, not the older one."""
    path = tmp_path / "ckpt"
    _, second = _save_killed_between_renames(path, monkeypatch)

    def dies_writing(*args, **kwargs):
        raise SystemExit("killed while writing shards")

    monkeypatch.setattr(qdcp.dcp, "save", dies_writing)
    with pytest.raises(SystemExit):
        qdcp.save(_quantized_state(3, None), path)
    monkeypatch.undo()
    assert qdcp.is_complete(path)
    sd = _quantized_state(2, None)
    qdcp.load(sd, path)
    assert all(_same(sd[k], second[k]) for k in sd)


def test_save_killed_between_renames_loads_a_complete_checkpoint(tmp_path, monkeypatch):
    """Rank 0 dies after moving the previous checkpoint aside and before renaming the new one
    into place ([Note: complete checkpoints]): both are complete, PATH is missing; `load(PATH)`
    reads the new one, and the next save to PATH completes and clears the leftovers. (A rank
    killed while writing its shards: tests/test_checkpoint_fsdp.py.)"""
    path = tmp_path / "ckpt"
    first, second = _save_killed_between_renames(path, monkeypatch)
    assert not path.exists()
    assert qdcp.is_complete(tmp_path / "ckpt.old") and qdcp.is_complete(tmp_path / "ckpt.incomplete")
    sd = _quantized_state(2, None)
    with pytest.warns(UserWarning, match="died while renaming"):
        qdcp.load(sd, path)
    assert all(_same(sd[k], second[k]) for k in sd)
    qdcp.save(first, path)
    assert qdcp.is_complete(path)
    assert not (tmp_path / "ckpt.old").exists() and not (tmp_path / "ckpt.incomplete").exists()
    sd = _quantized_state(2, None)
    qdcp.load(sd, path)
    assert all(_same(sd[k], first[k]) for k in sd)
