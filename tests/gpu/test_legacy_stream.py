"""What the transports assume about CUDA's legacy default stream: a query of it reports work
still running on a blocking stream as pending (an operation on the legacy stream waits for such
work), so an idle legacy stream means the caller's earlier work has run."""

from __future__ import annotations

import numpy as np
import pytest

SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
}
"""


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "non-blocking"])
def test_legacy_stream_query_sees_blocking_streams(blocking: bool) -> None:
    import cupy

    kernel = cupy.RawKernel(SPIN, "spin")
    other = cupy.cuda.Stream(non_blocking=not blocking)
    legacy = cupy.cuda.ExternalStream(0)
    cupy.cuda.Device().synchronize()
    assert legacy.done
    kernel((1,), (1,), (np.int64(400_000_000),), stream=other)  # about 0.2 s
    pending = not legacy.done
    other.synchronize()
    assert legacy.done
    # a blocking stream's work holds the legacy stream; a non-blocking one's does not
    assert pending is blocking
