"""Unit tests for hetcomm.arrays: numpy / buffer / DLPack / CUDA-array-interface views (torch
tensors: test_arrays_torch.py)."""

from __future__ import annotations

import array
import sys
from typing import Any

import numpy as np
import pytest
import torch

from hetcomm.arrays import Buffer, as_buffer, overlap, own_block
from hetcomm.dtypes import DTYPES, FLOATS, HALVES, storage_dtype
from hetcomm.errors import DtypeError, InvalidArgument

NUMPY_DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "float16", "float32", "float64")
TORCH_DTYPES = {
    "bool": torch.bool,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}
# numpy 2 moved byte_bounds into numpy.lib.array_utils
BYTE_BOUNDS = getattr(getattr(np.lib, "array_utils", np), "byte_bounds", None) or np.byte_bounds
# the module name as_buffer gives as `kind` to objects of classes defined in this file
HERE = __name__.partition(".")[0]


def random_numpy(dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    rng = np.random.default_rng()
    if dtype == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    if dtype.startswith(("int", "uint")):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    return rng.standard_normal(size=shape).astype(dtype)


def random_torch(dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    if dtype == "bfloat16":
        return torch.from_numpy(random_numpy("float32", shape)).to(torch.bfloat16)
    return torch.from_numpy(random_numpy(dtype, shape))


def bits_of(t: torch.Tensor) -> np.ndarray:
    """The storage values of a CPU tensor as numpy (uint16 bits for bfloat16), packed, 1-D."""
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16).reshape(-1).copy()
    return t.numpy().reshape(-1).copy()


class DLPackOnly:
    """Exposes a torch tensor through __dlpack__ / __dlpack_device__ only."""

    def __init__(self, t: torch.Tensor) -> None:
        self._t = t

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        return self._t.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self) -> Any:
        return self._t.__dlpack_device__()


class FakeDLPackDevice:
    """A DLPack object that claims to live on device type `dev_type`."""

    def __init__(self, dev_type: int, dev_id: int = 0) -> None:
        self.dev = (dev_type, dev_id)

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("must not be exported")

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.dev


class FakeCAI:
    """A device array known only through its __cuda_array_interface__."""

    def __init__(
        self,
        shape: tuple[int, ...],
        typestr: str = "<f4",
        ptr: int = 0x7F0000001000,
        readonly: bool = False,
        strides: tuple[int, ...] | None = None,
    ) -> None:
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": typestr,
            "data": (ptr, readonly),
            "strides": strides,
            "version": 3,
        }


class _Dev:
    def __init__(self, id: int) -> None:  # mirrors cupy's Device.id
        self.id = id


class FakeCAIWithDevice(FakeCAI):
    """Like cupy: a `device` attribute whose `id` is the device index."""

    def __init__(self, index: int, **kw: Any) -> None:
        super().__init__((3,), **kw)
        self.device = _Dev(index)


# ---- numpy --------------------------------------------------------------------------------------


def test_dtype_tables() -> None:
    assert set(NUMPY_DTYPES) | {"bfloat16"} == set(DTYPES)
    assert set(TORCH_DTYPES) == set(DTYPES)
    assert set(HALVES) <= set(FLOATS) <= set(DTYPES)
    assert storage_dtype("bfloat16") == np.dtype(np.uint16)
    for name in NUMPY_DTYPES:
        assert storage_dtype(name) == np.dtype(name)


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
@pytest.mark.parametrize("shape", [(17,), (3, 5), (2, 3, 4), (1,)])
def test_numpy_every_dtype(dtype: str, shape: tuple[int, ...]) -> None:
    arr = random_numpy(dtype, shape)
    buf = as_buffer(arr)
    assert isinstance(buf, Buffer)
    assert buf.obj is arr
    assert buf.kind == "numpy"
    assert buf.dtype == dtype
    assert buf.shape == shape
    assert buf.device == "cpu" and buf.device_index is None and not buf.on_device
    assert buf.contiguous and not buf.readonly
    assert buf.count == arr.size
    assert buf.itemsize == arr.itemsize
    assert buf.nbytes == arr.nbytes
    assert buf.ptr == arr.ctypes.data
    assert buf.span() == (arr.ctypes.data, arr.ctypes.data + arr.nbytes)
    assert buf.host is not None
    assert buf.host.ndim == 1 and buf.host.dtype == arr.dtype
    assert np.shares_memory(buf.host, arr)
    np.testing.assert_array_equal(buf.flat(), arr.reshape(-1))
    assert buf.flat() is buf.host  # contiguous: no copy


@pytest.mark.parametrize("dtype", ["int32", "float64", "uint8"])
def test_numpy_host_view_writes_through(dtype: str) -> None:
    arr = random_numpy(dtype, (4, 6))
    fresh = random_numpy(dtype, (24,))
    buf = as_buffer(arr)
    assert buf.host is not None
    buf.host[:] = fresh
    np.testing.assert_array_equal(arr.reshape(-1), fresh)


@pytest.mark.parametrize(
    "make",
    [
        lambda a: a[:, ::2],
        lambda a: a.T,
        lambda a: a[::-1],
        lambda a: a[1:, 1:],
        lambda a: a[:, 3],
        lambda a: np.broadcast_to(a[0], (4, a.shape[1])),
    ],
    ids=["every-other-column", "transpose", "reversed", "inner-block", "one-column", "broadcast"],
)
@pytest.mark.parametrize("dtype", ["float32", "int16", "bool"])
def test_numpy_non_contiguous(make: Any, dtype: str) -> None:
    base = random_numpy(dtype, (5, 7))
    view = make(base)
    buf = as_buffer(view)
    assert not buf.contiguous
    assert buf.shape == view.shape
    assert buf.count == view.size
    assert buf.ptr == view.__array_interface__["data"][0]
    assert buf.host is not None and buf.host.shape == view.shape
    assert np.shares_memory(buf.host, base)
    flat = buf.flat()
    assert flat.ndim == 1 and flat.flags.c_contiguous
    np.testing.assert_array_equal(flat, np.ascontiguousarray(view).reshape(-1))
    lo, hi = buf.span()
    assert lo <= base.ctypes.data + base.nbytes and hi >= base.ctypes.data
    assert (lo, hi) == BYTE_BOUNDS(view)


def test_numpy_size_one_dims_with_odd_strides_are_contiguous() -> None:
    base = random_numpy("float32", (6, 6))
    view = base[2:3, :]  # one row: contiguous whatever its outer stride
    assert as_buffer(view).contiguous


def test_numpy_readonly() -> None:
    arr = random_numpy("float64", (8,))
    arr.flags.writeable = False
    buf = as_buffer(arr)
    assert buf.readonly
    assert not as_buffer(random_numpy("float64", (8,))).readonly
    assert as_buffer(np.broadcast_to(np.float32(1), (4,))).readonly


@pytest.mark.parametrize("shape", [(0,), (0, 3), (3, 0, 2)])
def test_numpy_zero_size(shape: tuple[int, ...]) -> None:
    buf = as_buffer(np.empty(shape, dtype=np.float32))
    assert buf.shape == shape
    assert buf.count == 0 and buf.nbytes == 0
    assert buf.contiguous
    assert buf.flat().size == 0
    lo, hi = buf.span()
    assert lo == hi


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
def test_numpy_zero_dim(dtype: str) -> None:
    arr = random_numpy(dtype, ())
    buf = as_buffer(arr)
    assert buf.shape == ()
    assert buf.count == 1
    assert buf.nbytes == arr.itemsize
    assert buf.contiguous
    assert buf.flat().shape == (1,)
    assert buf.flat()[0] == arr[()]
    assert buf.describe() == f"numpy {dtype}[] on cpu"


def test_numpy_subclass() -> None:
    class Sub(np.ndarray):
        pass

    arr = random_numpy("int32", (5,)).view(Sub)
    buf = as_buffer(arr)
    assert (buf.kind, buf.dtype, buf.shape) == ("numpy", "int32", (5,))


@pytest.mark.parametrize(
    "dtype",
    [
        "complex64",
        "complex128",
        "uint16",
        "uint32",
        "uint64",
        "longdouble",
        "object",
        "U3",
        "S4",
        "datetime64[s]",
        "timedelta64[ms]",
    ],
)
def test_numpy_unsupported_dtype(dtype: str) -> None:
    arr = np.zeros(3, dtype=dtype)
    with pytest.raises(DtypeError) as info:
        as_buffer(arr, what="x")
    msg = str(info.value)
    assert msg == f"x: expected one of {', '.join(DTYPES)}, got numpy {arr.dtype.name}"
    assert isinstance(info.value, InvalidArgument) and isinstance(info.value, TypeError)


def test_numpy_big_endian_is_refused() -> None:
    with pytest.raises(DtypeError):
        as_buffer(np.zeros(3, dtype=">f4"))
    with pytest.raises(DtypeError):
        as_buffer(np.zeros(3, dtype=">i8"))


def test_numpy_big_endian_message_names_the_byte_order() -> None:
    with pytest.raises(DtypeError) as info:
        as_buffer(np.zeros(3, dtype=">f4"))
    assert not str(info.value).endswith("got numpy float32")


# ---- other objects ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("obj", "name"),
    [
        ([1, 2, 3], "builtins.list"),
        (5, "builtins.int"),
        (2.5, "builtins.float"),
        (None, "builtins.NoneType"),
        ("abc", "builtins.str"),
        (b"abc", "builtins.bytes"),
        ((1, 2), "builtins.tuple"),
        ({"a": 1}, "builtins.dict"),
    ],
)
def test_non_arrays_are_invalid(obj: Any, name: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        as_buffer(obj, what="out")
    msg = str(info.value)
    assert msg.startswith("out: expected a numpy, torch, cupy or numba array")
    assert msg.endswith(f"got {name}")
    assert not isinstance(info.value, DtypeError)


def test_bytearray() -> None:
    data = bytearray(np.random.default_rng().integers(0, 256, size=16, dtype=np.uint8).tobytes())
    buf = as_buffer(data)
    assert (buf.kind, buf.dtype, buf.shape) == ("buffer", "uint8", (16,))
    assert buf.obj is data
    assert buf.contiguous and not buf.readonly
    assert buf.host is not None
    buf.host[0] = (data[0] + 1) % 256
    assert data[0] == buf.host[0]  # a view, not a copy


def test_memoryview_of_bytes_is_readonly() -> None:
    buf = as_buffer(memoryview(b"hello"))
    assert (buf.kind, buf.dtype, buf.shape, buf.readonly) == ("buffer", "uint8", (5,), True)


@pytest.mark.parametrize(
    ("code", "dtype"),
    [
        ("f", "float32"),
        ("d", "float64"),
        ("b", "int8"),
        ("B", "uint8"),
        ("h", "int16"),
        ("i", "int32"),
        ("q", "int64"),
    ],
)
def test_memoryview_formats(code: str, dtype: str) -> None:
    values = array.array(code, range(6))
    buf = as_buffer(memoryview(values))
    assert (buf.dtype, buf.shape, buf.contiguous) == (dtype, (6,), True)
    np.testing.assert_array_equal(buf.flat(), np.arange(6))


def test_memoryview_strided_and_of_numpy() -> None:
    arr = random_numpy("float64", (10,))
    buf = as_buffer(memoryview(arr)[::2])
    assert not buf.contiguous
    np.testing.assert_array_equal(buf.flat(), arr[::2])
    buf2 = as_buffer(memoryview(arr))
    assert buf2.dtype == "float64" and buf2.ptr == arr.ctypes.data


def test_memoryview_unsupported_format() -> None:
    with pytest.raises(DtypeError, match="got buffer uint16"):
        as_buffer(memoryview(array.array("H", [1, 2])))


# ---- DLPack -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [d for d in TORCH_DTYPES if d != "bfloat16"])
def test_dlpack_cpu(dtype: str) -> None:
    t = random_torch(dtype, (3, 4))
    w = DLPackOnly(t)
    buf = as_buffer(w)
    assert buf.obj is w
    assert buf.kind == HERE
    assert (buf.dtype, buf.shape, buf.device) == (dtype, (3, 4), "cpu")
    assert buf.contiguous
    assert buf.ptr == t.data_ptr()
    np.testing.assert_array_equal(buf.flat(), bits_of(t))


def test_dlpack_shares_memory() -> None:
    t = random_torch("float32", (6,))
    buf = as_buffer(DLPackOnly(t))
    assert buf.host is not None
    buf.host[2] = 42.0
    assert t[2].item() == 42.0


def test_dlpack_non_contiguous() -> None:
    t = random_torch("int32", (4, 5)).t()
    buf = as_buffer(DLPackOnly(t))
    assert not buf.contiguous
    np.testing.assert_array_equal(buf.flat(), bits_of(t))


def test_dlpack_unsupported_dtype() -> None:
    with pytest.raises(DtypeError, match=r"got \S+ complex64$"):
        as_buffer(DLPackOnly(torch.zeros(2, dtype=torch.complex64)))


def test_dlpack_bfloat16() -> None:
    t = random_torch("bfloat16", (4,))
    buf = as_buffer(DLPackOnly(t))
    assert buf.dtype == "bfloat16"
    np.testing.assert_array_equal(buf.flat(), bits_of(t))


def test_dlpack_unsupported_device_type() -> None:
    with pytest.raises(InvalidArgument, match="DLPack device type 4 is not supported"):
        as_buffer(FakeDLPackDevice(4))


@pytest.mark.parametrize("dev_type", [2, 10], ids=["cuda", "rocm"])
def test_dlpack_on_gpu_without_cupy(dev_type: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` raises ImportError
    with pytest.raises(InvalidArgument, match="a DLPack array on a GPU needs cupy"):
        as_buffer(FakeDLPackDevice(dev_type), what="x")


# ---- CUDA array interface -----------------------------------------------------------------------


def test_cuda_array_interface() -> None:
    x = FakeCAI((4, 8), ptr=0x10000)
    buf = as_buffer(x)
    assert buf.obj is x
    assert buf.kind == HERE
    assert (buf.dtype, buf.shape) == ("float32", (4, 8))
    assert buf.device == "cuda" and buf.on_device
    assert buf.device_index is None
    assert buf.contiguous and not buf.readonly
    assert buf.host is None
    assert buf.ptr == 0x10000
    assert buf.nbytes == 128
    assert buf.span() == (0x10000, 0x10000 + 128)
    assert buf.describe() == f"{HERE} float32[4, 8] on cuda"


def test_cuda_array_interface_readonly_and_device_index() -> None:
    assert as_buffer(FakeCAI((2,), readonly=True)).readonly
    buf = as_buffer(FakeCAIWithDevice(1))
    assert buf.device_index == 1
    assert buf.describe() == f"{HERE} float32[3] on cuda:1"


@pytest.mark.parametrize(
    ("typestr", "dtype"),
    [
        ("|b1", "bool"),
        ("|i1", "int8"),
        ("<i2", "int16"),
        ("<i4", "int32"),
        ("<i8", "int64"),
        ("|u1", "uint8"),
        ("<f2", "float16"),
        ("<f4", "float32"),
        ("<f8", "float64"),
    ],
)
def test_cuda_array_interface_typestrs(typestr: str, dtype: str) -> None:
    buf = as_buffer(FakeCAI((5,), typestr=typestr))
    assert buf.dtype == dtype
    assert buf.nbytes == 5 * np.dtype(dtype).itemsize


@pytest.mark.parametrize(
    ("shape", "strides", "contiguous"),
    [
        ((4, 8), (32, 4), True),  # explicit C order
        ((4, 8), (64, 4), False),  # padded rows
        ((4, 8), (4, 16), False),  # Fortran order
        ((8,), (8,), False),  # every other element
        ((1, 8), (999, 4), True),  # a size-1 dimension's stride does not matter
        ((0, 8), (32, 4), True),
    ],
)
def test_cuda_array_interface_strides(
    shape: tuple[int, ...], strides: tuple[int, ...], contiguous: bool
) -> None:
    buf = as_buffer(FakeCAI(shape, strides=strides))
    assert buf.contiguous is contiguous
    assert buf.host is None


@pytest.mark.parametrize("typestr", ["<c8", "<u2", "<u4", "<V2", "<f16", "|O8"])
def test_cuda_array_interface_unknown_typestr(typestr: str) -> None:
    with pytest.raises(DtypeError) as info:
        as_buffer(FakeCAI((3,), typestr=typestr), what="buf")
    assert str(info.value) == f"buf: expected one of {', '.join(DTYPES)}, got typestr {typestr!r}"


# ---- overlap ------------------------------------------------------------------------------------


def test_overlap_slices_of_one_array() -> None:
    base = random_numpy("float64", (100,))
    assert overlap(as_buffer(base[0:10]), as_buffer(base[5:15])) == "partial"
    assert overlap(as_buffer(base[0:10]), as_buffer(base[0:10])) == "same"
    assert overlap(as_buffer(base), as_buffer(base)) == "same"
    assert overlap(as_buffer(base[0:10]), as_buffer(base[10:20])) == "none"  # adjacent
    assert overlap(as_buffer(base[0:10]), as_buffer(base[50:60])) == "none"
    assert overlap(as_buffer(base), as_buffer(base[20:30])) == "partial"
    assert overlap(as_buffer(base[0:10]), as_buffer(base[0:9])) == "partial"


def test_own_block_is_exactly_the_ranks_block() -> None:
    out = random_numpy("float32", (4, 6))
    flat = out.reshape(-1)
    for rank in range(4):
        assert own_block(as_buffer(out[rank]), as_buffer(out), rank)
        assert not own_block(as_buffer(out[rank]), as_buffer(out), (rank + 1) % 4)
    assert own_block(as_buffer(flat), as_buffer(flat), 0)  # one rank: x is out
    assert not own_block(as_buffer(flat[1:7]), as_buffer(flat), 0)  # straddles two blocks
    assert not own_block(as_buffer(out[:, 0]), as_buffer(out.T.reshape(-1)), 0)  # strided x
    assert not own_block(as_buffer(flat[6:12].copy()), as_buffer(flat), 1)  # other memory


def test_overlap_different_arrays() -> None:
    a = random_numpy("float32", (64,))
    b = random_numpy("float32", (64,))
    assert overlap(as_buffer(a), as_buffer(b)) == "none"
    assert overlap(as_buffer(a), as_buffer(a.copy())) == "none"


def test_overlap_empty() -> None:
    base = random_numpy("int32", (20,))
    empty = np.empty(0, dtype=np.int32)
    assert overlap(as_buffer(empty), as_buffer(empty)) == "none"
    assert overlap(as_buffer(base[5:5]), as_buffer(base)) == "none"
    assert overlap(as_buffer(base), as_buffer(base[5:5])) == "none"


def test_overlap_strided_is_conservative() -> None:
    base = random_numpy("float32", (40,))
    # interleaved views share no element, but their byte ranges overlap: reported as partial
    assert overlap(as_buffer(base[::2]), as_buffer(base[1::2])) == "partial"
    assert overlap(as_buffer(base[::2]), as_buffer(base[::2])) == "partial"
    assert overlap(as_buffer(base[:20:2]), as_buffer(base[20:])) == "none"


def test_overlap_views_of_other_dtype_and_shape() -> None:
    base = random_numpy("float32", (4, 4))
    assert overlap(as_buffer(base), as_buffer(base.reshape(16))) == "same"
    assert overlap(as_buffer(base), as_buffer(base.view(np.int32))) == "same"
    assert overlap(as_buffer(base), as_buffer(base.view(np.uint8)[:1])) == "partial"


def test_overlap_device_and_host_never_overlap() -> None:
    arr = random_numpy("float32", (8,))
    dev = FakeCAI((8,), ptr=arr.ctypes.data)
    assert overlap(as_buffer(arr), as_buffer(dev)) == "none"
    assert overlap(as_buffer(dev), as_buffer(FakeCAI((8,), ptr=arr.ctypes.data))) == "same"
    assert overlap(as_buffer(dev), as_buffer(FakeCAI((8,), ptr=arr.ctypes.data + 16))) == "partial"
    other = FakeCAIWithDevice(1, ptr=arr.ctypes.data)
    assert overlap(as_buffer(dev), as_buffer(other)) == "none"  # another GPU


def test_overlap_torch_slices() -> None:
    t = random_torch("bfloat16", (32,))
    assert overlap(as_buffer(t[2:6]), as_buffer(t[4:8])) == "partial"
    assert overlap(as_buffer(t[2:6]), as_buffer(t[6:8])) == "none"
    assert overlap(as_buffer(t[2:6]), as_buffer(t[2:6])) == "same"


def test_overlap_random_slices_agree_with_numpy() -> None:
    rng = np.random.default_rng()
    base = random_numpy("int16", (200,))
    for _ in range(300):
        a0, a1, b0, b1 = (int(v) for v in rng.integers(0, 201, size=4))
        a, b = base[min(a0, a1) : max(a0, a1)], base[min(b0, b1) : max(b0, b1)]
        got = overlap(as_buffer(a), as_buffer(b))
        assert got == overlap(as_buffer(b), as_buffer(a))
        assert (got != "none") == np.shares_memory(a, b)
        if got == "same":
            assert a.ctypes.data == b.ctypes.data and a.size == b.size


# ---- describe -----------------------------------------------------------------------------------


def test_describe() -> None:
    assert as_buffer(np.zeros((4, 8), np.float32)).describe() == "numpy float32[4, 8] on cpu"
    assert as_buffer(torch.zeros(3, dtype=torch.bfloat16)).describe() == "torch bfloat16[3] on cpu"
    assert as_buffer(np.zeros(0, np.int8)).describe() == "numpy int8[0] on cpu"
    assert as_buffer(bytearray(2)).describe() == "buffer uint8[2] on cpu"
    assert as_buffer(DLPackOnly(torch.zeros(2, 2))).describe() == f"{HERE} float32[2, 2] on cpu"
