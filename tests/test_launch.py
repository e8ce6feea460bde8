"""The local multi-process harness (qtensor.distributed.launch): results in rank order, a rank's
exception surfaces, and only a failure to form the group is retried."""

import datetime

import pytest
import torch

from qtensor.distributed import launch


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


def test_failure_inside_fn_is_raised_once(monkeypatch):
    calls = []
    spawn = launch._spawn
    monkeypatch.setattr(launch, "_spawn", lambda *a: calls.append(1) or spawn(*a))
    with pytest.raises(Exception, match="rank 1 fails inside fn"):
        launch.run_local(fail_on_rank_1, 2)
    assert len(calls) == 1


def test_failure_to_join_is_retried(monkeypatch):
    calls = []
    spawn = launch._spawn

    def flaky(*a):  # the first attempt dies before any rank joins, as an aborted rendezvous
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("process 0 terminated with signal SIGABRT")
        return spawn(*a)

    monkeypatch.setattr(launch, "_spawn", flaky)
    with pytest.warns(RuntimeWarning, match="attempt 1 of 3.*SIGABRT"):
        assert launch.run_local(rank_sum, 2, 0) == [1, 1]
    assert len(calls) == 2


def test_failure_to_join_every_time_is_raised(monkeypatch):
    def dead(*a):
        raise RuntimeError("rendezvous aborted")

    monkeypatch.setattr(launch, "_spawn", dead)
    with pytest.warns(RuntimeWarning), pytest.raises(RuntimeError, match="rendezvous aborted"):
        launch.run_local(rank_sum, 2, 0)
