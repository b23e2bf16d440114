"""GPU tests: skipped, with the reason, where no CUDA or ROCm device is visible."""

from __future__ import annotations

import os
import sys

import pytest


def _gpu_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA or ROCm device visible to torch (CPU-only machine)"
    return None


@pytest.fixture(scope="session", autouse=True)
def _local_device() -> None:
    """Each rank on the device its topology names (node rank modulo the devices it sees): on a
    one-GPU machine every rank shares device 0; with several GPUs they spread over them."""
    if _gpu_reason() is None:
        from hetcomm.topology import use_local_device

        use_local_device()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = _gpu_reason()
    if reason is None:
        return
    for item in items:
        if "tests/gpu" in str(item.fspath):
            item.add_marker(pytest.mark.skip(reason=f"GPU test: {reason}"))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Print a failure the moment it happens: under mpirun a rank that crashes later would
    otherwise take the end-of-run summary with it."""
    if report.failed:
        rank = os.environ.get("OMPI_COMM_WORLD_RANK", "?")
        print(
            f"\n[rank {rank}] FAILED {report.nodeid} ({report.when}):\n"
            f"{report.longreprtext[-3000:]}",
            file=sys.stderr,
            flush=True,
        )
