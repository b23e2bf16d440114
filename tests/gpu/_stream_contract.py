"""The GPU stream contract, written once for every transport that moves device arrays.

The contract (README, "GPU streams"): an operation is ordered after the work already queued on
the array's current stream, later work on that stream sees its result, and waiting need not
block the calling thread. A transport's GPU test module subclasses `StreamContract`, naming the
communicator options that put its device collectives on that transport (`options`); the class
name names the transport in each test id (`TestStagedStreams::test_stream_order`). Run on a GPU
machine under mpirun (tests/gpu/conftest.py skips them elsewhere).
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from hetcomm.testing import assert_all_ranks


class StreamContract:
    """The contract's tests; a subclass sets `options` (hetcomm_make_comm's keywords)."""

    options: ClassVar[dict[str, Any]] = {}

    @pytest.mark.mpi(min_size=2)
    def test_stream_order(self, hetcomm_make_comm: Any) -> None:
        """Work queued before the call is seen by it; work queued after wait() sees the result."""
        torch = pytest.importorskip("torch")
        comm = hetcomm_make_comm(**self.options)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            x = torch.zeros(8 << 20, device="cuda")
            torch.cuda._sleep(20_000_000)  # keep the stream busy: the add below lands late
            x.add_(comm.rank + 1)
            work = comm.all_reduce(x, async_op=True)
            work.wait()
            y = x * 2  # queued after wait(): must see the reduced values
        stream.synchronize()
        want = 2.0 * sum(range(1, comm.size + 1))
        ok = bool((y == want).all().item())
        assert_all_ranks(comm, ok, f"expected {want} everywhere after the all_reduce")

    @pytest.mark.mpi(min_size=2)
    def test_calling_thread_not_blocked(self, hetcomm_make_comm: Any) -> None:
        """An asynchronous all_reduce of 256 MB returns before it has completed."""
        cupy = pytest.importorskip("cupy")
        comm = hetcomm_make_comm(**self.options)
        x = cupy.ones(64 << 20, dtype=cupy.float32)
        work = comm.all_reduce(x, async_op=True)
        started_pending = not work.test()
        work.wait()
        ok = bool((x == comm.size).all()) and started_pending
        assert_all_ranks(comm, ok, "the call returned only after completion, or a wrong result")
