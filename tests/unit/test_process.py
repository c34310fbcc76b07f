"""The process a run lives in (ulysses_cp.core.process): each CPU rank's thread count, the
user's OMP_NUM_THREADS winning over it; a process no launcher started is a world of one."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from ulysses_cp.core import process
from ulysses_cp.core.process import cpu_threads, one_process_rendezvous, set_cpu_threads


@pytest.mark.parametrize(
    ("env", "cores", "threads"),
    [
        ({}, 8, 8),  # one process: every core
        ({"LOCAL_WORLD_SIZE": "2"}, 8, 4),  # torchrun, accelerate
        ({"LOCAL_SIZE": "3"}, 8, 2),  # DeepSpeed's launcher: rounded down
        ({"LOCAL_WORLD_SIZE": "4", "LOCAL_SIZE": "2"}, 8, 2),  # torchrun's name first
        ({"LOCAL_WORLD_SIZE": "4"}, 2, 1),  # more ranks than cores: at least one
        ({"LOCAL_WORLD_SIZE": "x"}, 8, 8),  # not a count: one rank
    ],
)
def test_each_cpu_rank_gets_the_cores_over_the_local_ranks(env, cores, threads):
    assert cpu_threads(env, cores=cores) == threads


@pytest.mark.parametrize("omp", ["1", "6"])
def test_the_users_omp_num_threads_wins(omp):
    assert cpu_threads({"OMP_NUM_THREADS": omp, "LOCAL_WORLD_SIZE": "2"}, cores=8) is None


@pytest.fixture
def torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_set_cpu_threads_sets_torch_unless_omp_is_set(monkeypatch, torch_threads, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(process, "_cores", lambda: 4)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    torch.set_num_threads(1)
    log = logging.getLogger("ulysses_cp.test_process")
    with caplog.at_level(logging.INFO, logger=log.name):
        assert set_cpu_threads(log) == 2
    assert torch.get_num_threads() == 2
    assert "CPU threads: 2 per rank (4 cores / local ranks)" in caplog.text
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    assert set_cpu_threads(log) is None
    assert torch.get_num_threads() == 1  # the user's choice stands


def _more_threads(rank: int) -> None:
    set_cpu_threads()  # what the Trainer's run does in a rank (left alone: OMP_NUM_THREADS)
    torch.set_num_threads(2)  # and what any other code might do


def _threads(rank: int) -> tuple[int, str]:
    return torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS", "")


def test_a_process_without_a_launcher_is_a_world_of_one():
    env: dict[str, str] = {}
    assert one_process_rendezvous(env) is True
    port = int(env.pop("MASTER_PORT"))
    assert 0 < port < 65536
    assert env == {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    # the user's own address and port are kept
    env = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29600"}
    assert one_process_rendezvous(env) is True
    assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["WORLD_SIZE"]) == ("10.0.0.1", "29600", "1")


@pytest.mark.parametrize(
    "key", ["RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SM_TRAINING_ENV"]
)
def test_a_launchers_environment_is_left_alone(key):
    """torchrun's and DeepSpeed's ranks, MPI's (DeepSpeed's mpi4py search) and the
    clouds' (DeepSpeed reads them) are not made a world of one."""
    env = {key: "4"}
    assert one_process_rendezvous(env) is False
    assert env == {key: "4"}
