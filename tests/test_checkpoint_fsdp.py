"""Sharded checkpoints of real FSDP2 models (qtensor.distributed.fully_shard), 2 ranks.

The workers take the device: here they run on the CPU over gloo, tests/test_fsdp_gpu.py runs
them on 2 GPUs over NCCL. One spawned group of 2 ranks runs every distributed check; the
1-rank runs use a process group of rank 0 alone (rank 1 waits at a barrier), so no second
group is spawned:

- inference: a model with NVFP4 (4over6 bound 256, row-scaled, 16x16 tiles), MXFP8 and
  HybridTensor weights, `fully_shard`ed, saved with qtensor.checkpoint.dcp on 2 ranks and on 1;
  loaded on 2 ranks, on 1 and (in the test process) into a model that was never sharded.
  Outputs after loading equal the saved model's bit for bit.
- training: the NVFP4 recipe with quantize-on-gather master weights (qtensor/distributed/
  master.py), Adam, stochastic rounding (its `sr_state` buffers, saved with
  `dcp.sr_states`) and a quantized buffer; saved after two steps on 2 ranks and on 1, resumed
  on 2 ranks and on 1 in a model built from another seed. The next step's loss, master
  weights, Adam state and buffers equal those of the run that was not interrupted, bit for bit.
- a rank killed mid-save (a second group, spawned first): after checkpoint 1, rank 1 exits
  (`os._exit`) while DCP writes checkpoint 2 to the same path. Checkpoint 1 is still there,
  loads on 2 ranks and resumes bit for bit; the half-written directory is refused. The other
  window of the save, rank 0 dying between its two renames, is checked in one process.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import qtensor
from qtensor import HybridTensor, MXFP8Spec, NVFP4Spec, NVFP4Tensor
from qtensor.checkpoint import dcp as qdcp
from qtensor.tensors import QuantizedTensor
from qtensor.testing.launch import run_local

# Weight formats of the inference model; each Linear pair is 64 -> 64 -> 128, so every shard of
# 2 ranks keeps whole blocks (16x16 tiles: 32 rows; the hybrid's MXFP8 columnwise side: 32 rows).
KINDS = {
    "nvfp4_4o6_b256": lambda: qtensor.NVFP4DynamicActivationNVFP4WeightConfig(
        weight=NVFP4Spec(fourover6="mae", e4m3_bound=256),
        activation=NVFP4Spec(fourover6="mse", e4m3_bound=256)),
    "nvfp4_rowscaled": lambda: qtensor.NVFP4DynamicActivationNVFP4WeightConfig(
        weight=NVFP4Spec(row_scaled=True), activation=NVFP4Spec(row_scaled=True)),
    "nvfp4_2d": lambda: qtensor.NVFP4WeightOnlyConfig(weight=NVFP4Spec(block_2d=True)),
    "mxfp8": lambda: qtensor.MXFP8DynamicActivationMXFP8WeightConfig(),
    "hybrid": None,  # NVFP4 2D fprop side, MXFP8 dgrad side from the decoded rowwise bytes
}


class Zoo(nn.Module):
    """One MLP per weight format, run on the same input (FSDP2's root needs a forward)."""

    def __init__(self):
        super().__init__()
        self.mlps = nn.ModuleDict()

    def forward(self, x) -> dict[str, torch.Tensor]:
        return {kind: mlp(x) for kind, mlp in self.mlps.items()}


def inference_model(seed: int) -> Zoo:
    torch.manual_seed(seed)
    zoo = Zoo()
    models = zoo.mlps
    for kind, config in KINDS.items():
        mlp = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 128)).to(torch.bfloat16)
        if config is not None:
            qtensor.quantize_(mlp, config())
        else:
            for lin in (mlp[0], mlp[2]):
                w = HybridTensor.from_hp(lin.weight.detach(), rowwise=NVFP4Spec(block_2d=True),
                                         columnwise=MXFP8Spec(),
                                         columnwise_source="rowwise_dequantized")
                lin.weight = nn.Parameter(w, requires_grad=False)
        models[kind] = mlp
    return zoo


def shard_inference(zoo: Zoo, mesh) -> Zoo:
    from qtensor.distributed import fully_shard

    zoo.to(mesh.device_type)
    for mlp in zoo.mlps.values():
        for lin in (mlp[0], mlp[2]):
            fully_shard(lin, mesh=mesh)
    fully_shard(zoo, mesh=mesh)
    return zoo


def x_inference() -> torch.Tensor:
    return torch.randn(6, 64, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)


@torch.no_grad()
def outputs(zoo: Zoo) -> dict[str, torch.Tensor]:
    return zoo(x_inference().to(_device(zoo)))


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


# ---- training -----------------------------------------------------------------------------------


class FrozenProjection(nn.Module):
    """A frozen NVFP4 projection held as a buffer: quantized state outside the optimizer."""

    def __init__(self):
        super().__init__()
        w = torch.randn(64, 64) / 8
        self.register_buffer("weight", NVFP4Tensor.from_hp(w, row_scaled=True))

    def forward(self, x):
        return F.linear(x, self.weight)


def training_model(mesh, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from qtensor.distributed import fully_shard, quantize_on_gather
    from qtensor.training import NVFP4TrainingRecipe, TrainingConfig

    torch.manual_seed(seed)  # the same weights on every device: made on the CPU, then moved
    model = nn.Sequential(FrozenProjection(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 128))
    model.to(mesh.device_type)
    qtensor.quantize_(model, TrainingConfig(NVFP4TrainingRecipe()))  # fp32 masters, SR on
    quantize_on_gather(model)
    for lin in (model[1], model[3]):
        fully_shard(lin, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train_step(model, opt, step: int) -> torch.Tensor:
    from qtensor.distributed import precompute_amaxes

    x = torch.randn(32, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(step))
    precompute_amaxes(model)
    x = x.to(_device(model))
    loss = model(x).float().square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def training_state(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "sr": qdcp.sr_states(model)}


def resume(model, opt, path, group) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = training_state(model, opt)
    qdcp.load(state, path, process_group=group)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def full_training_state(model, opt) -> list[torch.Tensor]:
    """Every master weight, bias and Adam state, gathered (collective), and every buffer (the
    quantized one's bytes, the stochastic-rounding positions), as plain tensors."""
    from torch.distributed.tensor import DTensor

    def full(t):
        t = t.full_tensor() if isinstance(t, DTensor) else t
        t = getattr(t, "_data", t)  # a QuantizeOnGatherWeight's master
        if isinstance(t, QuantizedTensor):
            return torch.cat([full(getattr(t, n)).reshape(-1).view(torch.uint8)
                              for n in t.tensor_data_names])
        return t.detach().clone()

    out = []
    for p in model.parameters():
        out.append(full(p))
        out += [full(v) for _, v in sorted(opt.state[p].items())]
    return out + [full(b) for b in model.buffers()]


# ---- the 2-rank worker -----------------------------------------------------------------------


def one_rank_group(device: str):
    """(mesh, group) of rank 0 alone; rank 1 gets (None, None). Collective on every rank."""
    from torch.distributed.device_mesh import DeviceMesh

    group = dist.new_group([0])
    if dist.get_rank() != 0:
        return None, None
    return DeviceMesh.from_group(group, device), group


def worker(rank: int, world: int, tmp: str, device: str = "cpu") -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh2 = init_device_mesh(device, (world,))
    mesh1, group1 = one_rank_group(device)
    result = {}

    # inference: save from 2 ranks and from 1, load each on 2 ranks and on 1
    models = inference_model(0).to(device)
    want = outputs(models)
    if rank == 0:
        torch.save({k: v.cpu() for k, v in want.items()}, os.path.join(tmp, "want.pt"))
    qdcp.save(shard_inference(models, mesh2).state_dict(), os.path.join(tmp, "inf2"))
    result["saved_sharded_equal"] = _equal(outputs(models), want)
    if rank == 0:
        m1 = shard_inference(inference_model(0), mesh1)
        qdcp.save(m1.state_dict(), os.path.join(tmp, "inf1"), process_group=group1)
    dist.barrier()
    for src in ("inf1", "inf2"):
        fresh = shard_inference(inference_model(1), mesh2)
        qdcp.load(fresh.state_dict(), os.path.join(tmp, src))
        result[f"{src}->2"] = _equal(outputs(fresh), want)
        if rank == 0:
            fresh = shard_inference(inference_model(1), mesh1)
            qdcp.load(fresh.state_dict(), os.path.join(tmp, src), process_group=group1)
            result[f"{src}->1"] = _equal(outputs(fresh), want)
        dist.barrier()

    # training: steps 1..N, save, step N+1 (the reference); resume on 2 ranks and on 1
    result.update(_training(rank, mesh2, mesh1, group1, tmp))
    # the run whose second save was killed: its first checkpoint resumes on 2 ranks
    killed = os.path.join(tmp, "killed")
    if os.path.isdir(killed):
        model, opt = training_model(mesh2, 1)
        resume(model, opt, os.path.join(killed, "ckpt"), None)
        got = (train_step(model, opt, STEPS + 1), full_training_state(model, opt))
        result["killed->2"] = _equal_step(got, torch.load(os.path.join(killed, "ref.pt")))
    return result


STEPS = 2  # training steps before the checkpoint


def _train_and_save(mesh, group, path) -> tuple:
    """Steps 1..STEPS, save to `path`, then step STEPS + 1: (its loss, the full state after
    it), on the CPU: what a resumed run must reproduce."""
    model, opt = training_model(mesh, 0)
    for step in range(1, STEPS + 1):
        train_step(model, opt, step)
    qdcp.save(training_state(model, opt), path, process_group=group)
    return _cpu((train_step(model, opt, STEPS + 1), full_training_state(model, opt))), model, opt


def _cpu(step) -> tuple:
    loss, state = step
    return loss.cpu(), [t.cpu() for t in state]


def _training(rank, mesh2, mesh1, group1, tmp) -> dict:
    """Save after STEPS steps on 2 ranks and on 1, remember the next step of the uninterrupted
    runs, then resume each checkpoint on 2 ranks and on 1 (in a model built from another seed)
    and take that step there."""
    runs = [("train2", mesh2, None)] + ([("train1", mesh1, group1)] if rank == 0 else [])
    ref = {}
    for name, mesh, group in runs:
        ref[name] = _train_and_save(mesh, group, os.path.join(tmp, name))[0]
        dist.barrier(group)
    dist.barrier()
    result = {"sr_states": sorted(qdcp.sr_states(training_model(mesh2, 0)[0]))}
    for src in ("train1", "train2"):
        model, opt = training_model(mesh2, 1)
        resume(model, opt, os.path.join(tmp, src), None)
        got = (train_step(model, opt, STEPS + 1), full_training_state(model, opt))
        if rank == 0:
            result[f"{src}->2"] = _equal_step(got, ref[src])
    if rank == 0:
        for src in ("train1", "train2"):
            model, opt = training_model(mesh1, 1)
            resume(model, opt, os.path.join(tmp, src), group1)
            got = (train_step(model, opt, STEPS + 1), full_training_state(model, opt))
            result[f"{src}->1"] = _equal_step(got, ref[src])
    dist.barrier()
    return result


def killed_worker(rank: int, world: int, tmp: str, device: str = "cpu") -> None:
    """Checkpoint 1 after STEPS steps; the next step's result (the reference a resume must
    reproduce) to ref.pt; then rank 1 exits while DCP writes checkpoint 2 to the same path."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.device_mesh import init_device_mesh

    path = os.path.join(tmp, "ckpt")
    ref, model, opt = _train_and_save(init_device_mesh(device, (world,)), None, path)
    if rank == 0:
        torch.save(ref, os.path.join(tmp, "ref.pt"))
    dist.barrier()
    if rank == 1:  # dies while writing its shards, after planning with rank 0
        FileSystemWriter.write_data = lambda *a, **k: os._exit(3)
    try:
        qdcp.save(training_state(model, opt), path)
    except Exception:
        os._exit(0)  # rank 0 sees the collective fail, as a real job would
    os._exit(4)  # not reached: the save cannot complete without rank 1


def _equal(a: dict, b: dict) -> dict[str, bool]:
    return {k: torch.equal(a[k], b[k]) for k in b}


def _equal_step(got, ref) -> list[bool]:
    loss, state = _cpu(got)
    return [torch.equal(loss, ref[0])] + [torch.equal(x, y) for x, y in zip(state, ref[1],
                                                                            strict=True)]


def run_killed_save(tmp: str, device: str = "cpu", backend: str = "gloo") -> None:
    """The killed save in tmp/killed: run_local raises (a rank exited), and must."""
    import datetime

    killed = os.path.join(tmp, "killed")
    os.makedirs(killed)
    try:
        # When rank 1 exits, the spawn ends rank 0 at once: the timeout only bounds a hang,
        # and leaves a GPU's first-call kernel compiles time before the first collectives.
        run_local(killed_worker, 2, killed, device, backend=backend,
                  timeout=datetime.timedelta(seconds=120))
    except Exception:
        return
    raise AssertionError("the save with a killed rank finished")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    import warnings

    tmp = tmp_path_factory.mktemp("fsdp_dcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_killed_save(str(tmp))
        results = run_local(worker, 2, str(tmp))
    return tmp, results


def test_sharding_keeps_outputs(saved):
    _, results = saved
    for res in results:
        assert all(res["saved_sharded_equal"].values()), res["saved_sharded_equal"]


@pytest.mark.parametrize("route", ["inf1->2", "inf2->2", "inf1->1", "inf2->1"])
def test_inference_checkpoint_reshards(saved, route):
    _, results = saved
    ranks = results if route.endswith("2") else results[:1]
    for res in ranks:
        assert res[route] == {k: True for k in KINDS}, route


@pytest.mark.parametrize("src", ["inf1", "inf2"])
def test_inference_checkpoint_into_unsharded_model(saved, src):
    tmp, _ = saved
    models = inference_model(1)
    want = torch.load(tmp / "want.pt")
    assert not any(_equal(outputs(models), want).values())  # the load has work to do
    qdcp.load(models.state_dict(), tmp / src)
    assert _equal(outputs(models), want) == {k: True for k in KINDS}


@pytest.mark.parametrize("route", ["train2->1", "train1->2", "train2->2", "train1->1",
                                   "killed->2"])
def test_training_resumes_bitwise(saved, route):
    _, results = saved
    checks = results[0][route]
    # the loss; 4 parameters x (master, Adam exp_avg, exp_avg_sq, step); 3 buffers (the frozen
    # NVFP4 projection, the two TrainingLinears' stochastic-rounding positions)
    assert len(checks) == 1 + 4 * 4 + 3 and all(checks), checks


def test_training_checkpoint_holds_the_rounding_state(saved):
    _, results = saved
    assert results[0]["sr_states"] == ["1.sr_state", "3.sr_state"]


def test_master_weights_load_unwrapped_and_drop_their_amax(tmp_path):
    """A quantize-on-gather master (not sharded here) is stored as the plain tensor it wraps
    (no qtensor class pickled into the checkpoint) and loaded into the wrapped tensor in place;
    its global amax, taken before the load, is dropped so the next forward asks for a new one."""
    from qtensor.distributed.master import QuantizeOnGatherWeight
    from qtensor.training import NVFP4TrainingRecipe

    role = NVFP4TrainingRecipe().operand_specs().weight
    src = QuantizeOnGatherWeight(torch.randn(64, 64), role)
    qdcp.save({"w": src}, tmp_path / "ckpt")
    dst = QuantizeOnGatherWeight(torch.zeros(64, 64), role)
    dst.amax, dst._amax_stamp = torch.tensor(1.0), (dst, dst._version)
    qdcp.load({"w": dst}, tmp_path / "ckpt")
    assert torch.equal(dst._data, src._data)
    assert dst.amax is None and dst._amax_stamp is None
    # DCP wrote a plain tensor: the file loads with weights_only=True, no qtensor class in it
    stored = [f for f in os.listdir(tmp_path / "ckpt") if f.endswith(".distcp")]
    for f in stored:
        with open(tmp_path / "ckpt" / f, "rb") as fh:
            assert b"QuantizeOnGatherWeight" not in fh.read()


def test_killed_save_leaves_the_previous_checkpoint(saved):
    """After the killed save: checkpoint 1 complete in place (it resumed bit for bit on 2
    ranks: killed->2 above), checkpoint 2's directory without the marker and refused."""
    tmp, _ = saved
    ckpt = tmp / "killed" / "ckpt"
    assert qdcp.is_complete(ckpt)
    assert (tmp / "killed" / "ckpt.incomplete").is_dir()  # rank 0's shards, no marker
    assert not qdcp.is_complete(tmp / "killed" / "ckpt.incomplete")
    with pytest.raises(qdcp.CheckpointError, match="not a complete qtensor checkpoint"):
        qdcp.read_entries(tmp / "killed" / "ckpt.incomplete")
