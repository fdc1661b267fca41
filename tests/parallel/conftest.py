"""Shared pieces of the tensor-parallel tests: gloo ranks as threads of the test process (for
layer math), and engines whose rank processes are stopped when a test is done."""
from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

from vllm_omni.model_executor.parallel_state import TPGroup, create_group, host_store, join_store

TIMEOUT_S = 60.0


def run_ranks(size: int, fn: Callable[[TPGroup], object]) -> list[object]:
    """fn(group) on `size` gloo ranks, one thread each; returns each rank's result in rank order."""
    store = host_store(size, TIMEOUT_S)
    results: list[object] = [None] * size
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            rank_store = store if rank == 0 else join_store(store.port, size, TIMEOUT_S)
            results[rank] = fn(create_group(rank_store, rank, size, torch.device("cpu"), TIMEOUT_S))
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    assert not any(t.is_alive() for t in threads), "a rank thread hung"
    if errors:
        raise errors[0]
    return results


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One torch thread per process in these tests: the ranks share the machine's cores, and
    OpenMP threads spin-waiting against each other make every step many times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
