"""Unit tests for hetcomm.arrays on torch tensors (CPU): every dtype, views that write through,
strided tensors, what is refused."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
import torch
from test_arrays import TORCH_DTYPES, bits_of, random_numpy, random_torch

from hetcomm.arrays import as_buffer, overlap
from hetcomm.dtypes import DTYPES, storage_dtype
from hetcomm.errors import DtypeError, InvalidArgument


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
@pytest.mark.parametrize("shape", [(11,), (4, 3), (2, 2, 5)])
def test_torch_every_dtype(dtype: str, shape: tuple[int, ...]) -> None:
    t = random_torch(dtype, shape)
    buf = as_buffer(t)
    assert buf.obj is t
    assert buf.kind == "torch"
    assert buf.dtype == dtype
    assert buf.shape == shape
    assert buf.device == "cpu" and buf.device_index is None and not buf.on_device
    assert buf.contiguous and not buf.readonly
    assert buf.count == t.numel()
    assert buf.itemsize == t.element_size()
    assert buf.nbytes == t.numel() * t.element_size()
    assert buf.ptr == t.data_ptr()
    assert buf.host is not None
    assert buf.host.ndim == 1
    assert buf.host.dtype == storage_dtype(dtype)
    assert buf.host.ctypes.data == t.data_ptr()
    np.testing.assert_array_equal(buf.flat(), bits_of(t))


def test_torch_bfloat16_host_is_uint16_sharing_memory() -> None:
    rng = np.random.default_rng()
    t = torch.from_numpy(rng.standard_normal(10).astype(np.float32)).to(torch.bfloat16)
    buf = as_buffer(t)
    assert buf.dtype == "bfloat16"
    assert buf.itemsize == 2
    assert buf.host is not None and buf.host.dtype == np.uint16
    # bfloat16 bits are the top 16 bits of the float32 value
    values = rng.integers(-100, 100, size=10).astype(np.float32) / 4  # exact in bfloat16
    buf.host[:] = (values.view(np.uint32) >> 16).astype(np.uint16)
    assert torch.equal(t, torch.from_numpy(values).to(torch.bfloat16))
    t[3] = 1.5
    assert buf.host[3] == 0x3FC0


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
def test_torch_host_view_writes_through(dtype: str) -> None:
    t = random_torch(dtype, (12,))
    fresh = random_torch(dtype, (12,))
    buf = as_buffer(t)
    assert buf.host is not None
    buf.host[:] = bits_of(fresh)
    assert torch.equal(t, fresh)


@pytest.mark.parametrize(
    "make",
    [
        lambda t: t.t(),
        lambda t: t[:, ::2],
        lambda t: t[1:, 1:],
        lambda t: t[:, 2],
        lambda t: t[0].expand(4, -1),
    ],
    ids=["transpose", "every-other-column", "inner-block", "one-column", "expand"],
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64", "bool"])
def test_torch_non_contiguous(make: Any, dtype: str) -> None:
    base = random_torch(dtype, (5, 6))
    view = make(base)
    assert not view.is_contiguous()
    buf = as_buffer(view)
    assert not buf.contiguous
    assert buf.shape == tuple(view.shape)
    assert buf.ptr == view.data_ptr()
    assert buf.host is not None and buf.host.shape == tuple(view.shape)
    assert buf.host.dtype == storage_dtype(dtype)
    flat = buf.flat()
    assert flat.ndim == 1 and flat.flags.c_contiguous
    np.testing.assert_array_equal(flat, bits_of(view))


def test_torch_non_contiguous_host_view_writes_through() -> None:
    base = random_torch("float32", (4, 4))
    view = base.t()
    buf = as_buffer(view)
    assert buf.host is not None
    buf.host[0, 1] = 123.0
    assert base[1, 0].item() == 123.0


def test_torch_zero_size_and_zero_dim() -> None:
    empty = as_buffer(torch.empty(0, 4, dtype=torch.bfloat16))
    assert empty.shape == (0, 4) and empty.count == 0 and empty.nbytes == 0
    assert empty.flat().size == 0
    for dtype in TORCH_DTYPES:
        t = random_torch(dtype, ())
        buf = as_buffer(t)
        assert buf.shape == () and buf.count == 1 and buf.contiguous
        np.testing.assert_array_equal(buf.flat(), bits_of(t))
        assert buf.describe() == f"torch {dtype}[] on cpu"


def test_torch_requires_grad_and_parameter() -> None:
    t = random_torch("float32", (3,)).requires_grad_()
    assert as_buffer(t).dtype == "float32"
    p = torch.nn.Parameter(random_torch("float32", (2, 2)))
    buf = as_buffer(p)
    assert buf.kind == "torch" and buf.shape == (2, 2)


@pytest.mark.parametrize(
    "dtype",
    [torch.complex64, torch.complex128, torch.uint16, torch.uint32, torch.float8_e4m3fn],
)
def test_torch_unsupported_dtype(dtype: torch.dtype) -> None:
    t = torch.zeros(3, dtype=dtype)
    name = str(dtype).removeprefix("torch.")
    with pytest.raises(DtypeError) as info:
        as_buffer(t, what="grad")
    assert str(info.value) == f"grad: expected one of {', '.join(DTYPES)}, got torch {name}"


def test_torch_sparse_is_refused() -> None:
    t = torch.eye(3).to_sparse()
    with pytest.raises(InvalidArgument, match="expected a dense \\(strided\\) tensor, got layout"):
        as_buffer(t)


def test_torch_meta_device_is_refused() -> None:
    t = torch.empty(4, device="meta")
    with pytest.raises(InvalidArgument, match="tensors on meta are not supported"):
        as_buffer(t)


def test_torch_module_object_that_is_not_a_tensor() -> None:
    with pytest.raises(InvalidArgument, match=re.escape("expected a torch.Tensor, got Size")):
        as_buffer(torch.Size([2, 3]))


def test_torch_sharing_numpy_memory() -> None:
    arr = random_numpy("float32", (10,))
    t = torch.from_numpy(arr)
    assert overlap(as_buffer(arr), as_buffer(t)) == "same"
