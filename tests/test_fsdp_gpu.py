"""The FSDP2 tests of test_fsdp_inference.py and test_fsdp_training.py on 2 GPUs over NCCL.

Run by benchmarks/gpu_check.sh on a two-GPU machine; skipped with fewer GPUs. The checks are
the CPU ones: outputs and gradients bitwise equal to the unsharded model, quantized bytes in
the all-gather.
"""

from __future__ import annotations

import pytest
import torch

from qtensor.testing.launch import run_local
from test_fsdp_inference import KINDS, fsdp_worker
from test_fsdp_training import RECIPES, training_worker

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs for NCCL"),
]


def test_fsdp_inference_nccl():
    for rank_results in run_local(fsdp_worker, 2, "cuda", backend="nccl"):
        for (kind, reshard), res in rank_results.items():
            assert res["equal"] == [True, True], (kind, reshard)
            assert all(res["gathered_weights_equal"]) and res["local_equal"] == [True, True]
        first = rank_results[("nvfp4", True)]["calls"][0]
        assert sum(n for _, n in first) == (rank_results[("nvfp4", True)]["weight_shard_bytes"]
                                            + rank_results[("nvfp4", True)]["bias_shard_bytes"])
    assert set(k for k, _ in rank_results) == set(KINDS)


def test_fsdp_training_nccl():
    for rank_runs in run_local(training_worker, 2, "cuda", backend="nccl"):
        for (recipe, reshard), res in rank_runs.items():
            for step, checks in enumerate(res["equal"]):
                assert all(checks), (recipe, reshard, step, checks)
            assert res["all_reduces"] == [1, 1]
    assert set(r for r, _ in rank_runs) == set(RECIPES)
