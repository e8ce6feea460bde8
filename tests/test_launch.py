"""The local multi-process harness (qtensor.testing.launch): results in rank order, and a
rank's exception is the one raised, not the drain barrier's error on the rank that waited."""

import datetime

import pytest
import torch

from qtensor.testing import launch


def rank_sum(rank: int, world: int, base: int) -> int:
    import torch.distributed as dist

    t = torch.tensor([rank + base])
    dist.all_reduce(t)
    return t.item()


def fail_on_rank_1(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 fails inside fn")


def test_results_in_rank_order():
    assert launch.run_local(rank_sum, 2, 10, timeout=datetime.timedelta(seconds=60)) == [21, 21]


@pytest.mark.parametrize("attempt", range(3))  # the race between the two ranks' exits
def test_failure_inside_fn_is_the_error_raised(attempt):
    with pytest.raises(Exception, match="rank 1 fails inside fn"):
        launch.run_local(fail_on_rank_1, 2)
