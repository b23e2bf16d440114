"""What the transports assume about CUDA's legacy default stream: a query of it reports work
still running on a blocking stream as pending (an operation on the legacy stream waits for such
work), so an idle legacy stream means the caller's earlier work has run."""

from __future__ import annotations

import warnings

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
    from hetcomm.kernels.device import external_stream

    kernel = cupy.RawKernel(SPIN, "spin")
    other = cupy.cuda.Stream(non_blocking=not blocking)
    legacy = external_stream(0)
    cupy.cuda.Device().synchronize()
    assert legacy.done
    kernel((1,), (1,), (np.int64(400_000_000),), stream=other)  # about 0.2 s
    pending = not legacy.done
    other.synchronize()
    assert legacy.done
    # a blocking stream's work holds the legacy stream; a non-blocking one's does not
    assert pending is blocking


def test_a_callers_stream_is_wrapped_once_on_its_device_without_deprecated_calls() -> None:
    import cupy
    from hetcomm.kernels.device import external_stream

    own = cupy.cuda.Stream(non_blocking=True)
    device = cupy.cuda.Device().id
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # CuPy 14 deprecates ExternalStream
        wrapped = external_stream(own.ptr, device)
        assert external_stream(own.ptr, device) is wrapped
    # the device it was made on, or -1 (unknown: CuPy 14.2's from_external leaves it so)
    assert wrapped.ptr == own.ptr and wrapped.device_id in (device, -1)
    with wrapped:  # x made there too: the stream does not wait for the legacy one
        x = cupy.arange(1 << 20, dtype=cupy.float32)
        y = x * 2
    wrapped.synchronize()
    np.testing.assert_array_equal(cupy.asnumpy(y), np.arange(1 << 20, dtype=np.float32) * 2)
