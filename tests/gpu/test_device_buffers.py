"""Device arrays are described correctly, and the plan refuses them where nothing can move them."""

from __future__ import annotations

import numpy as np
import pytest

from hetcomm.arrays import as_buffer

torch = pytest.importorskip("torch")


def test_torch_cuda_tensor_is_a_device_buffer() -> None:
    t = torch.arange(12, dtype=torch.float32, device="cuda").reshape(3, 4)
    b = as_buffer(t)
    assert b.on_device and b.device in ("cuda", "rocm")
    assert b.device_index == t.device.index
    assert b.ptr == t.data_ptr() and b.count == 12 and b.dtype == "float32"
    assert b.contiguous and b.host is None
    assert not as_buffer(t.t()).contiguous


def test_torch_cuda_bfloat16() -> None:
    t = torch.zeros(5, dtype=torch.bfloat16, device="cuda")
    b = as_buffer(t)
    assert b.dtype == "bfloat16" and b.nbytes == 10


def test_cupy_and_numba_arrays() -> None:
    cupy = pytest.importorskip("cupy")
    c = cupy.arange(10, dtype=cupy.float64)
    b = as_buffer(c)
    assert b.kind == "cupy" and b.on_device and b.ptr == c.data.ptr and b.count == 10
    numba_cuda = pytest.importorskip("numba.cuda")
    d = numba_cuda.to_device(np.arange(6, dtype=np.int32))
    nb = as_buffer(d)
    assert nb.kind == "numba" and nb.on_device and nb.count == 6 and nb.dtype == "int32"
