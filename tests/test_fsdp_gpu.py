"""The distributed FSDP2 and DCP tests on 2 GPUs over NCCL: the CPU tests' own assertions.

Run by benchmarks/gpu_check.sh on a two-GPU machine; skipped with fewer GPUs. The workers of
test_fsdp_inference.py, test_fsdp_training.py and test_checkpoint_fsdp.py take the device, so
the same worker runs on gloo in CI and on NCCL here; each module fixture below spawns it on
2 GPUs, and the test functions imported from those files assert on its results:

- inference: NVFP4 (1x16, 16x16 tiles, row-scaled), MXFP8, HybridTensor and FP8 block
  parameters sharded on block boundaries; outputs bitwise equal to the unsharded model on one
  GPU; each all-gather moves the quantized bytes (NVFP4 <= 0.3x bf16, MXFP8 <= 0.55x);
- training: quantize-before-all-gather with the NVFP4 2D, dgrad_mxfp8 and 1x16 recipes,
  outputs, gradient shards and weights after two steps bitwise equal to the unsharded run;
- DCP: train 2 steps, save on 2 ranks and on 1, load on 2 and on 1, the next step bitwise
  equal; a rank killed mid-save leaves the previous checkpoint loadable.

The tests left out need the CPU: the refusal messages (the worker checks them on the CPU
only) and loading a GPU-saved checkpoint into a CPU model (products on another backend).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from qtensor.testing.launch import run_local
from test_checkpoint_fsdp import (  # noqa: F401  (collected here, on the NCCL results)
    run_killed_save,
    test_inference_checkpoint_reshards,
    test_killed_save_leaves_the_previous_checkpoint,
    test_sharding_keeps_outputs,
    test_training_checkpoint_holds_the_rounding_state,
    test_training_resumes_bitwise,
    worker as checkpoint_worker,
)
from test_fsdp_inference import (  # noqa: F401
    fsdp_worker,
    test_all_gather_bytes_per_module_vs_bf16,
    test_fsdp_all_gather_moves_quantized_bytes,
    test_fsdp_no_reshard_gathers_once,
    test_fsdp_outputs_equal_unsharded,
)
from test_fsdp_training import (  # noqa: F401
    test_all_gather_moves_quantized_weights,
    test_sharded_training_matches_unsharded,
    test_stale_amax_is_refused,
    training_worker,
)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs for NCCL"),
]


def _nccl(fn, *args):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_local(fn, 2, *args, "cuda", backend="nccl")


@pytest.fixture(scope="module")
def fsdp_results():
    return _nccl(fsdp_worker)


@pytest.fixture(scope="module")
def runs():
    return _nccl(training_worker)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp_dcp_nccl")
    run_killed_save(str(tmp), "cuda", "nccl")
    return tmp, _nccl(checkpoint_worker, str(tmp))


def test_every_rank_ran_every_case(fsdp_results, runs, saved):
    from test_fsdp_inference import KINDS
    from test_fsdp_training import RECIPES

    for rank_results in fsdp_results:
        assert {key[0] for key in rank_results if isinstance(key, tuple)} == set(KINDS)
    for rank_runs in runs:
        assert {r for r, _ in rank_runs} == set(RECIPES)
    assert {"train1->2", "train2->2", "train1->1", "train2->1", "killed->2"} <= set(saved[1][0])
