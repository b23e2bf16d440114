"""Arrays of every supported library (numpy, torch, cupy, numba) seen as one Buffer view."""

from __future__ import annotations

from typing import Any

import numpy as np

from .dtypes import DTYPES, TABLE, storage_dtype
from .errors import DtypeError, InvalidArgument

__all__ = ["DTYPES", "Buffer", "as_buffer", "overlap", "storage_dtype"]

# numpy dtype of a host view -> logical dtype name (bfloat16 has none: it is never inferred)
#: np.may_share_memory without its __array_function__ dispatch (half its 0.6 us): numpy's
#: dispatchers keep the function they wrap as `_implementation`
may_share_memory = getattr(np.may_share_memory, "_implementation", np.may_share_memory)

_NUMPY_NAMES = {d.numpy: n for n, d in TABLE.items() if n != "bfloat16"}
# typestr of the CUDA array interface (without byte order) -> dtype name
_TYPESTR = {
    "b1": "bool",
    "i1": "int8",
    "i2": "int16",
    "i4": "int32",
    "i8": "int64",
    "u1": "uint8",
    "f2": "float16",
    "f4": "float32",
    "f8": "float64",
}
_DLPACK_CPU, _DLPACK_CUDA, _DLPACK_CUDA_HOST, _DLPACK_ROCM = 1, 2, 3, 10


class Buffer:
    """One array, whatever its library: dtype, shape, where it lives and a host view if on the CPU.

    `host` is a numpy view of the same memory in the storage dtype (uint16 for bfloat16), flat
    when the array is contiguous and strided otherwise; it is None for device memory.
    """

    __slots__ = (
        "_ptr",
        "contiguous",
        "count",
        "device",
        "device_index",
        "dtype",
        "host",
        "itemsize",
        "kind",
        "obj",
        "readonly",
        "shape",
    )

    def __init__(
        self,
        *,
        obj: Any,
        kind: str,
        dtype: str,
        shape: tuple[int, ...],
        device: str,
        device_index: int | None,
        ptr: int,
        contiguous: bool,
        readonly: bool,
        host: np.ndarray | None,
        count: int = -1,
    ) -> None:
        self.obj, self.kind, self.dtype, self.shape = obj, kind, dtype, shape
        self.device, self.device_index, self._ptr = device, device_index, ptr
        self.contiguous, self.readonly, self.host = contiguous, readonly, host
        self.itemsize = TABLE[dtype].itemsize
        if count < 0:
            count = 1
            for n in shape:
                count *= n
        self.count = count

    @property
    def ptr(self) -> int:
        """Address of the first element (-1 given at construction means: ask the host view)."""
        if self._ptr < 0 and self.host is not None:
            self._ptr = int(self.host.__array_interface__["data"][0])
        return self._ptr

    @property
    def nbytes(self) -> int:
        """Size in bytes (count times itemsize)."""
        return self.count * self.itemsize

    @property
    def on_device(self) -> bool:
        """Whether the array lives in GPU memory."""
        return self.device != "cpu"

    def describe(self) -> str:
        """e.g. 'torch bfloat16[4, 8] on cuda:0'."""
        where = self.device if self.device_index is None else f"{self.device}:{self.device_index}"
        shape = ", ".join(str(n) for n in self.shape)
        return f"{self.kind} {self.dtype}[{shape}] on {where}"

    def flat(self) -> np.ndarray:
        """A contiguous 1-D host view (or a packed copy when the array is strided)."""
        assert self.host is not None, "flat() is for host buffers"
        if self.contiguous:
            return self.host
        return np.ascontiguousarray(self.host).reshape(-1)

    def span(self) -> tuple[int, int]:
        """[start, end) of the bytes this buffer may touch (for aliasing checks)."""
        if self.contiguous or self.host is None:
            return self.ptr, self.ptr + self.nbytes
        lo, hi = _byte_bounds(self.host)
        return lo, hi


def as_buffer(x: Any, what: str = "array") -> Buffer:
    """Describe `x` as a Buffer; raises DtypeError / InvalidArgument naming what arrived."""
    if type(x) is np.ndarray:
        return _from_numpy(x, x, "numpy", what)
    module = type(x).__module__.partition(".")[0]
    if module == "torch":
        return _from_torch(x, what)
    if module == "cupy" and type(x).__name__ == "ndarray":
        return _from_cupy(x, what)
    if hasattr(x, "__cuda_array_interface__"):
        return _from_cuda_interface(x, module or "cuda", what)
    if isinstance(x, np.ndarray):  # subclasses, ml_dtypes arrays
        return _from_numpy(x, x, "numpy", what)
    if hasattr(x, "__dlpack_device__") and hasattr(x, "__dlpack__"):
        return _from_dlpack(x, module, what)
    if isinstance(x, (bytearray, memoryview)):
        return _from_numpy(np.asarray(x), x, "buffer", what)
    raise InvalidArgument(
        f"{what}: expected a numpy, torch, cupy or numba array (or any DLPack / "
        "CUDA-array-interface "
        f"object), got {type(x).__module__}.{type(x).__qualname__}"
    )


def _dtype_name(dt: np.dtype, what: str, kind: str) -> str:
    name = _NUMPY_NAMES.get(dt)
    if name is None:
        if dt.name == "bfloat16":  # ml_dtypes' bfloat16 (as used by JAX)
            return "bfloat16"
        got = dt.name if dt.isnative or dt.itemsize == 1 else f"{dt.str} (non-native byte order)"
        raise DtypeError(f"{what}: expected one of {', '.join(DTYPES)}, got {kind} {got}")
    return name


def _from_numpy(arr: np.ndarray, obj: Any, kind: str, what: str) -> Buffer:
    # on the path of every call: keep it to a few attribute reads
    dtype = _NUMPY_NAMES.get(arr.dtype) or _dtype_name(arr.dtype, what, kind)
    view = arr.view(np.uint16) if dtype == "bfloat16" else arr
    flags = arr.flags
    contiguous = flags.c_contiguous
    host = view if not contiguous or view.ndim == 1 else view.reshape(-1)
    return Buffer(
        obj=obj,
        kind=kind,
        dtype=dtype,
        shape=arr.shape,
        device="cpu",
        device_index=None,
        ptr=-1,
        contiguous=contiguous,
        readonly=not flags.writeable,
        host=host,
        count=arr.size,
    )


_TORCH: dict[Any, str] = {}  # torch dtype -> name, filled on first use (torch imported lazily)


def _torch_names(torch: Any) -> dict[Any, str]:
    if not _TORCH:
        for name in DTYPES:
            _TORCH[getattr(torch, name)] = name
    return _TORCH


def _from_torch(t: Any, what: str) -> Buffer:
    import torch

    if not isinstance(t, torch.Tensor):
        raise InvalidArgument(f"{what}: expected a torch.Tensor, got {type(t).__qualname__}")
    # on the path of every call: torch attribute reads cost ~0.1-0.8 µs each, so read few
    name = _TORCH.get(t.dtype) or _torch_names(torch).get(t.dtype)
    if name is None:
        got = str(t.dtype).removeprefix("torch.")
        raise DtypeError(f"{what}: expected one of {', '.join(DTYPES)}, got torch {got}")
    if t.layout is not torch.strided:
        raise InvalidArgument(f"{what}: expected a dense (strided) tensor, got layout {t.layout}")
    shape = tuple(t.shape)
    contiguous = t.is_contiguous()
    if t.is_cpu:
        d = t.detach() if t.requires_grad else t
        if name == "bfloat16":
            host = d.view(torch.int16).numpy().view(np.uint16)
        else:
            host = d.numpy()
        if contiguous and host.ndim != 1:
            host = host.reshape(-1)
        return Buffer(
            obj=t,
            kind="torch",
            dtype=name,
            shape=shape,
            device="cpu",
            device_index=None,
            ptr=-1,
            contiguous=contiguous,
            readonly=False,
            host=host,
        )
    if t.device.type == "cuda":
        device = "rocm" if getattr(torch.version, "hip", None) else "cuda"
        return Buffer(
            obj=t,
            kind="torch",
            dtype=name,
            shape=shape,
            device=device,
            device_index=t.device.index,
            ptr=t.data_ptr(),
            contiguous=contiguous,
            readonly=False,
            host=None,
        )
    raise InvalidArgument(f"{what}: tensors on {t.device.type} are not supported (cpu, cuda)")


def _from_cupy(x: Any, what: str) -> Buffer:
    """A cupy array from its attributes: on the path of every call, and cupy builds its
    __cuda_array_interface__ dict afresh at each read (several microseconds)."""
    name = _NUMPY_NAMES.get(x.dtype)
    if name is None or not x.size:  # other dtypes (named there) and empty arrays
        return _from_cuda_interface(x, "cupy", what)
    device = "rocm" if _is_hip("cupy") else "cuda"
    return Buffer(
        obj=x,
        kind="cupy",
        dtype=name,
        shape=x.shape,
        device=device,
        device_index=x.device.id,
        ptr=x.data.ptr,
        contiguous=x.flags.c_contiguous,
        readonly=False,
        host=None,
        count=x.size,
    )


def _from_cuda_interface(x: Any, module: str, what: str) -> Buffer:
    cai = x.__cuda_array_interface__
    typestr = cai["typestr"]
    name = _TYPESTR.get(typestr[1:])
    if name is None:
        raise DtypeError(f"{what}: expected one of {', '.join(DTYPES)}, got typestr {typestr!r}")
    shape = tuple(int(n) for n in cai["shape"])
    ptr = int(cai["data"][0])
    itemsize = TABLE[name].itemsize
    strides = cai.get("strides")
    contiguous = strides is None or _c_contiguous(shape, tuple(strides), itemsize)
    readonly = bool(cai["data"][1])
    device_index = _device_of(x, module)
    device = "rocm" if _is_hip(module) else "cuda"
    kind = "numba" if module == "numba" else module
    return Buffer(
        obj=x,
        kind=kind,
        dtype=name,
        shape=shape,
        device=device,
        device_index=device_index,
        ptr=ptr,
        contiguous=contiguous,
        readonly=readonly,
        host=None,
    )


def _from_dlpack(x: Any, module: str, what: str) -> Buffer:
    dev_type, _dev_id = x.__dlpack_device__()
    if dev_type in (_DLPACK_CPU, _DLPACK_CUDA_HOST):
        try:
            arr = np.from_dlpack(x)
        except (RuntimeError, BufferError, TypeError) as exc:
            # numpy has no bfloat16; torch reads any DLPack dtype hetcomm supports
            try:
                import torch
            except ImportError:
                raise DtypeError(f"{what}: numpy cannot view this DLPack array ({exc})") from None
            return _from_torch(torch.from_dlpack(x), what)
        return _from_numpy(arr, x, module or "dlpack", what)
    if dev_type in (_DLPACK_CUDA, _DLPACK_ROCM):
        try:
            import cupy
        except ImportError:
            raise InvalidArgument(
                f"{what}: a DLPack array on a GPU needs cupy to be viewed (pip install "
                f"hetcomm[cuda]); got {type(x).__qualname__}"
            ) from None
        return _from_cuda_interface(cupy.from_dlpack(x), "cupy", what)
    raise InvalidArgument(f"{what}: DLPack device type {dev_type} is not supported")


def _c_contiguous(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> bool:
    expected = itemsize
    for n, s in zip(reversed(shape), reversed(strides)):
        if n > 1 and s != expected:
            return False
        expected *= n
    return True


def _device_of(x: Any, module: str) -> int | None:
    dev = getattr(x, "device", None)
    for attr in ("id", "index"):
        value = getattr(dev, attr, None)
        if isinstance(value, int):
            return value
    if module == "numba":
        try:
            from numba import cuda

            return int(cuda.get_current_device().id)
        except Exception:
            return None
    return None


def _is_hip(module: str) -> bool:
    if module != "cupy":
        return False
    try:
        import cupy

        return bool(cupy.cuda.runtime.is_hip)
    except Exception:
        return False


def overlap(a: Buffer, b: Buffer) -> str:
    """'none', 'same' (identical memory and size) or 'partial'."""
    if a.device != b.device or a.device_index != b.device_index:
        return "none"
    a0, a1 = a.span()
    b0, b1 = b.span()
    if a1 <= b0 or b1 <= a0 or a0 == a1 or b0 == b1:
        return "none"
    if (a0, a1) == (b0, b1) and a.contiguous and b.contiguous:
        return "same"
    return "partial"


def own_block(x: Buffer, out: Buffer, index: int) -> bool:
    """Whether `x` is exactly block `index` of `out` (blocks the size of `x`), both contiguous
    in the same memory: the in-place all_gather (x in out) and reduce_scatter (out in x), which
    every transport serves as they are (NCCL's rules: sendbuff == recvbuff + rank * sendcount,
    recvbuff == sendbuff + rank * recvcount)."""
    return (
        x.contiguous
        and out.contiguous
        and x.device == out.device
        and x.device_index == out.device_index
        and x.ptr == out.ptr + index * x.nbytes
    )


# numpy 2 moved byte_bounds into numpy.lib.array_utils
_numpy: Any = np
_array_utils: Any = getattr(np.lib, "array_utils", None)
_byte_bounds: Any = _array_utils.byte_bounds if _array_utils is not None else _numpy.byte_bounds
