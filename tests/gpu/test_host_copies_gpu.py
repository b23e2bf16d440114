"""Staged's copies between host and device on a GPU: small ones go as 2D rows
(hetcomm.kernels.host_copies), larger ones as one copy; each moves exactly its bytes.

Runs in one process and under mpirun, where every rank copies on the shared GPU at once.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest
from hetcomm.kernels.device import StagingDevice
from hetcomm.kernels.host_copies import SMALL_BYTES, rows

cupy = pytest.importorskip("cupy")
cupyx = pytest.importorskip("cupyx")

GUARD = 29  # odd: the copies start at addresses no row width divides


def _sizes(gen: np.random.Generator) -> list[int]:
    fixed = [1, 2, 3, 8, 63, 64, 65, 1000, 1024, 4099, 20011, 24576, SMALL_BYTES - 1]
    return fixed + [SMALL_BYTES, 65536 + 5] + [int(n) for n in gen.integers(2, SMALL_BYTES, 12)]


def test_copies_move_exactly_their_bytes() -> None:
    seed = int(os.environ.get("HETCOMM_TEST_SEED") or np.random.SeedSequence().entropy)
    gen = np.random.default_rng(seed)
    gpu = StagingDevice(1 << 16, 2)
    try:
        for nbytes in _sizes(gen):
            total = nbytes + 2 * GUARD
            values = gen.integers(0, 256, total, dtype=np.uint8)
            dev = cupy.asarray(values)  # queued on the current stream: the copies wait for it
            ready = cupy.cuda.Event(disable_timing=True)
            ready.record()
            host = cupyx.empty_pinned(total, np.uint8)
            host[:] = gen.integers(0, 256, total, dtype=np.uint8)
            before = host.copy()
            region = SimpleNamespace(dev=dev.data.ptr + GUARD, nbytes=nbytes, host=None)
            what = f"{nbytes} B ({len(rows(nbytes))} 2D copies), seed {seed}"

            gpu.copy_to_host(host[GUARD : GUARD + nbytes], region, ready)
            expected = before.copy()
            expected[GUARD : GUARD + nbytes] = values[GUARD : GUARD + nbytes]
            np.testing.assert_array_equal(host, expected, err_msg=f"to host: {what}")

            host[GUARD : GUARD + nbytes] = gen.integers(0, 256, nbytes, dtype=np.uint8)
            gpu.copy_from_host(region, host[GUARD : GUARD + nbytes], None)
            back = values.copy()
            back[GUARD : GUARD + nbytes] = host[GUARD : GUARD + nbytes]
            np.testing.assert_array_equal(cupy.asnumpy(dev), back, err_msg=f"to device: {what}")
    finally:
        gpu.close()
