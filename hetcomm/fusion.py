"""Tensor fusion: arrays checked, grouped by (dtype, memory) and packed into one buffer each."""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Sequence
from operator import attrgetter
from typing import TYPE_CHECKING, Any

import numpy as np
from mpi4py import MPI

from .arrays import Buffer, as_buffer
from .dtypes import TABLE, storage_dtype
from .errors import InvalidArgument, TransportUnavailable
from .ops import ReduceOp, check_op_for_dtype

if TYPE_CHECKING:
    from .comm import Communicator

# fused host buffers kept for reuse, per communicator and dtype, up to this size each
KEEP_BYTES = 64 << 20


class Group:
    """The arrays of one dtype in one memory, and the offset (in elements) of each in the fused
    buffer; arrays follow their order in the call, so every rank lays them out alike.

    Host arrays are kept as numpy views (`hosts`: flat where `dense`, else the strided view;
    the C-contiguous arrays of _numpy_groups as they were given); `bufs` holds each array's
    Buffer, except for plain numpy arrays that needed none.
    """

    __slots__ = (
        "addresses",
        "bufs",
        "contiguous",
        "counts",
        "dense",
        "device",
        "device_index",
        "dtype",
        "hosts",
        "index",
        "layouts",
        "offsets",
        "table",
        "total",
    )

    def __init__(self, dtype: str, device: str = "cpu", device_index: int | None = None) -> None:
        self.dtype, self.device, self.device_index = dtype, device, device_index
        self.bufs: list[Buffer] = []
        self.index: list[int] = []  # position of each array in the call
        self.hosts: list[np.ndarray] = []  # host groups only
        self.dense: list[bool] = []
        self.counts: list[int] = []
        self.offsets: list[int] = []
        self.layouts: list[tuple[tuple[int, ...], tuple[int, ...]]] = []  # device arrays only
        self.total = 0
        self.contiguous = True
        # contiguous host groups: the arrays' addresses where the check took them (a list),
        # and the table of the compiled copies (see host_table)
        self.addresses: list[int] | None = None
        self.table: tuple[np.ndarray, np.ndarray] | None = None

    def add(self, b: Buffer, i: int) -> None:
        """Add buffer `b`, argument number `i` of the call, to the group."""
        self.bufs.append(b)
        self.index.append(i)
        self.counts.append(b.count)
        self.dense.append(b.contiguous)
        if b.host is not None:
            self.hosts.append(b.host)

    def lay_out(self) -> None:
        """Place the arrays one after the other (offsets, total, whether all are contiguous)."""
        self.offsets = [0, *itertools.accumulate(self.counts)]
        self.total = self.offsets.pop()
        self.contiguous = all(self.dense)

    @property
    def on_device(self) -> bool:
        """Whether the group's arrays live in GPU memory."""
        return self.device != "cpu"

    def fused(self, flat: np.ndarray | None = None, ptr: int = 0) -> Buffer:
        """The fused buffer as the transports see it: a host array `flat`, or memory at `ptr`
        with the first array's library and device (whose current stream orders device work)."""
        if flat is not None:
            return Buffer(
                obj=flat,
                kind="numpy",
                dtype=self.dtype,
                shape=(self.total,),
                device="cpu",
                device_index=None,
                ptr=int(flat.__array_interface__["data"][0]),
                contiguous=True,
                readonly=False,
                host=flat,
                count=self.total,
            )
        if not self.bufs:  # plain numpy arrays: a description for the plan
            return Buffer(
                obj=None,
                kind="numpy",
                dtype=self.dtype,
                shape=(self.total,),
                device="cpu",
                device_index=None,
                ptr=0,
                contiguous=True,
                readonly=False,
                host=None,
                count=self.total,
            )
        first = self.bufs[0]
        return Buffer(
            obj=first.obj,
            kind=first.kind,
            dtype=self.dtype,
            shape=(self.total,),
            device=self.device,
            device_index=self.device_index,
            ptr=ptr,
            contiguous=True,
            readonly=False,
            host=None,
            count=self.total,
        )


def prepare(arrays: Any, op: ReduceOp, what: str) -> tuple[list[Any], list[Group]]:
    """Check every array (before anything moves) and group them by (dtype, memory), in order of
    first appearance. Raises InvalidArgument / DtypeError naming the offending position."""
    if not isinstance(arrays, (list, tuple)):
        raise InvalidArgument(
            f"{what}: expected a list or tuple of arrays, got "
            f"{type(arrays).__module__}.{type(arrays).__qualname__}"
        )
    fast = _numpy_groups(arrays)
    if fast is not None:
        for g in fast:
            check_op_for_dtype(op, g.dtype, f"{what}: arrays[{g.index[0]}]")
        return list(arrays), fast
    bufs: list[Buffer] = []
    groups: dict[tuple[str, str, int | None], Group] = {}
    for i, x in enumerate(arrays):
        b = as_buffer(x, f"{what}: arrays[{i}]")
        if b.readonly:
            raise InvalidArgument(
                f"{what}: arrays[{i}] ({b.describe()}) is read-only, but every "
                "array is reduced in place"
            )
        key = (b.dtype, b.device, b.device_index)
        group = groups.get(key)
        if group is None:
            group = groups[key] = Group(*key)
        group.add(b, i)
        bufs.append(b)
    devices = [g for g in groups.values() if g.on_device]
    if len({(g.device, g.device_index) for g in devices}) > 1:
        first = devices[0]
        other = next(
            g for g in devices if (g.device, g.device_index) != (first.device, first.device_index)
        )
        raise InvalidArgument(
            f"{what}: device arrays must all live on one device; arrays[{first.index[0]}] is on "
            f"{first.bufs[0].describe()}, arrays[{other.index[0]}] on {other.bufs[0].describe()}"
        )
    for g in groups.values():
        check_op_for_dtype(op, g.dtype, f"{what}: arrays[{g.index[0]}]")
        if g.on_device:
            g.layouts = [device_layout(b, f"{what}: arrays[{i}]") for b, i in zip(g.bufs, g.index)]
        g.lay_out()
    check_disjoint(list(groups.values()), what)
    return bufs, list(groups.values())


_NUMPY_NAMES = {d.numpy: n for n, d in TABLE.items() if n != "bfloat16"}
_DTYPE, _FLAGS, _SIZE = attrgetter("dtype"), attrgetter("flags.num"), attrgetter("size")
_address = MPI.Get_address  # an array's address, without the dict of __array_interface__
# the bits of ndarray.flags.num (numpy's NPY_ARRAY_C_CONTIGUOUS, NPY_ARRAY_OWNDATA and
# NPY_ARRAY_WRITEABLE) that every array of the one-dtype fast path has
_PLAIN = 0x0001 | 0x0004 | 0x0400


def _numpy_groups(arrays: Sequence[Any]) -> list[Group] | None:
    """Groups of a call made only of plain, writable numpy arrays of hetcomm's dtypes, each of
    its own allocation: the common case, checked without a Buffer per array. None for anything
    else (the general path then checks, and names what is wrong).

    Arrays of one dtype that each own their memory, C-contiguous and writable, are checked by a
    few C-level `map`s over the list (a quarter of a microsecond per array); their addresses,
    which packing needs anyway, tell whether one was given twice: the memory of arrays that own
    it cannot overlap. Anything else goes through _numpy_groups_each.
    """
    ndarray = np.ndarray
    if not arrays:
        return []
    if set(map(type, arrays)) != {ndarray}:
        return None
    dtypes = set(map(_DTYPE, arrays))
    if len(dtypes) != 1 or any(bits & _PLAIN != _PLAIN for bits in set(map(_FLAGS, arrays))):
        return _numpy_groups_each(arrays)
    name = _NUMPY_NAMES.get(dtypes.pop())
    if name is None:
        return None
    n = len(arrays)
    addresses = list(map(_address, arrays))
    if len(set(addresses)) != n:
        return None  # an array given twice: the general path says which
    group = Group(name)
    group.index = list(range(n))
    group.counts = list(map(_SIZE, arrays))
    group.hosts = list(arrays)  # C-contiguous, packed by address: no flat views needed
    group.dense = [True] * n
    group.addresses = addresses
    group.lay_out()
    return [group]


def _numpy_groups_each(arrays: Sequence[Any]) -> list[Group] | None:
    """_numpy_groups array by array: several dtypes, views, strided arrays. The group of the
    previous array's dtype object is reused, and the owning arrays' identities are collected
    and compared once at the end."""
    ndarray = np.ndarray
    groups: dict[np.dtype, Group] = {}
    roots: list[int] = []
    last: Any = None
    for i, x in enumerate(arrays):
        if type(x) is not ndarray:
            return None
        dt = x.dtype
        if dt is not last:
            group = groups.get(dt)
            if group is None:
                name = _NUMPY_NAMES.get(dt)
                if name is None:
                    return None
                group = groups[dt] = Group(name)
            index, counts, hosts, dense = group.index, group.counts, group.hosts, group.dense
            last = dt
        flags = x.flags
        if not flags.writeable:
            return None
        # numpy arrays of different allocations cannot overlap
        root = x.base
        if root is None:
            if not flags.owndata:
                return None
            roots.append(id(x))
        else:
            while root.base is not None:
                root = root.base
            if type(root) is not ndarray or not root.flags.owndata:
                return None
            roots.append(id(root))
        index.append(i)
        counts.append(x.size)
        if flags.c_contiguous:
            hosts.append(x if x.ndim == 1 else x.reshape(-1))
            dense.append(True)
        else:
            hosts.append(x)
            dense.append(False)
    if len(set(roots)) != len(roots):
        return None  # an allocation given twice: the general path says which arrays overlap
    for g in groups.values():
        g.lay_out()
    return list(groups.values())


# ---- aliasing -----------------------------------------------------------------------------------


def span(b: Buffer, layout: tuple[tuple[int, ...], tuple[int, ...]] | None) -> tuple[int, int]:
    """[start, end) of the bytes `b` may touch; a device array's from its shape and strides."""
    if b.contiguous:
        ptr = b.ptr
        return ptr, ptr + b.count * b.itemsize
    if layout is None:
        return b.span()
    shape, strides = layout
    low = sum(min(0, (n - 1) * s) for n, s in zip(shape, strides))
    high = sum(max(0, (n - 1) * s) for n, s in zip(shape, strides))
    return b.ptr + low * b.itemsize, b.ptr + (high + 1) * b.itemsize


def check_disjoint(groups: Sequence[Group], what: str) -> None:
    """InvalidArgument when two arrays share memory (each would be reduced into the other)."""
    # numpy arrays whose memory numpy allocated can only overlap arrays of the same allocation:
    # the common case (separately allocated arrays) needs no addresses at all
    seen: set[int] = set()
    for g in groups:
        for b in g.bufs:
            owner = _allocation(b)
            if owner is None or owner in seen:
                break
            seen.add(owner)
        else:
            continue
        break
    else:
        return
    items: list[_Item] = []
    for g in groups:
        place = (g.device, g.device_index)
        for k, (b, i) in enumerate(zip(g.bufs, g.index)):
            if b.count:
                items.append((place, b, i, g.layouts[k] if g.layouts else None))
    _sweep(items, what)


# (memory place, buffer, position in the call, device layout or None)
_Item = tuple[tuple[str, "int | None"], Buffer, int, Any]


def _allocation(b: Buffer) -> int | None:
    """Identity of the numpy array that allocated `b`'s memory; None when numpy did not (or
    cannot tell), e.g. torch tensors, arrays over foreign buffers, device memory."""
    x = b.obj
    if type(x) is not np.ndarray:
        return None
    while True:
        base = x.base
        if base is None:
            return id(x) if x.flags.owndata else None
        if type(base) is not np.ndarray:
            return None
        x = base


def _sweep(items: list[_Item], what: str) -> None:
    """Sort by start address; each array is checked against the earlier ones still open."""
    spans = sorted((item[0], *span(item[1], item[3]), k) for k, item in enumerate(items))
    open_: list[tuple[int, int]] = []  # (end, index into items)
    place: Any = None
    for where, lo, hi, k in spans:
        if where != place:
            place, open_ = where, []
        open_ = [(end, j) for end, j in open_ if end > lo]
        for _, j in open_:
            a, b = items[j], items[k]
            kind = _overlap(a[1], a[3], b[1], b[3])
            if kind is None:
                continue
            first, second = sorted((a[2], b[2]))
            if kind == "same":
                raise InvalidArgument(
                    f"{what}: arrays[{first}] and arrays[{second}] are the same "
                    "array; each array may appear once (it would be reduced "
                    "twice)"
                )
            raise InvalidArgument(
                f"{what}: arrays[{first}] and arrays[{second}] overlap in "
                "memory; overlapping arrays would be reduced into each other"
            )
        open_.append((hi, k))


def _overlap(a: Buffer, la: Any, b: Buffer, lb: Any) -> str | None:
    """'same', 'partial' or None for two arrays whose byte ranges intersect."""
    if a.contiguous and b.contiguous:
        same = a.ptr == b.ptr and a.nbytes == b.nbytes
        return "same" if same else "partial"
    try:
        shared = _shares_memory(_probe(a, la), _probe(b, lb), max_work=100_000)
    except Exception:  # too hard to decide exactly: refuse, to be safe
        return "partial"
    if not shared:
        return None
    if a.ptr == b.ptr and a.shape == b.shape and _strides(a, la) == _strides(b, lb):
        return "same"
    return "partial"


def _strides(b: Buffer, layout: Any) -> tuple[int, ...]:
    if layout is not None:
        return tuple(layout[1])
    assert b.host is not None
    return tuple(b.host.strides)


# numpy's stubs admit only max_work -1 or 0, though any bound works
_shares_memory: Any = np.shares_memory


class _Interface:
    """Describes memory to numpy without numpy ever reading it (for np.shares_memory)."""

    def __init__(
        self, ptr: int, shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int
    ) -> None:
        self.__array_interface__ = {
            "data": (ptr, True),
            "shape": shape,
            "strides": strides,
            "typestr": f"|V{itemsize}",
            "version": 3,
        }


def _probe(b: Buffer, layout: Any) -> np.ndarray:
    """A numpy array over `b`'s addresses (a host view, or a description of device memory)."""
    if layout is None:
        assert b.host is not None
        return b.host
    shape, strides = layout
    return np.asarray(
        _Interface(b.ptr, tuple(shape), tuple(s * b.itemsize for s in strides), b.itemsize)
    )


# ---- host arrays --------------------------------------------------------------------------------


class HostBuffers:
    """Fused host buffers for reuse, one per dtype: taken by a call, given back at its end, so
    an operation in flight never shares its buffer."""

    def __init__(self) -> None:
        self._free: dict[np.dtype, np.ndarray] = {}
        self._lock = threading.Lock()

    def take(self, dtype: str, count: int) -> np.ndarray:
        """A 1-D buffer of at least `count` elements of `dtype`'s storage."""
        storage = storage_dtype(dtype)
        with self._lock:
            found = self._free.pop(storage, None)
        if found is not None and found.size >= count:
            return found
        return np.empty(max(count, 1), dtype=storage)

    def give(self, buf: np.ndarray) -> None:
        """Give a fused buffer back for a later call (too large ones are dropped)."""
        if buf.nbytes > KEEP_BYTES:
            return
        with self._lock:
            kept = self._free.get(buf.dtype)
            if kept is None or kept.size < buf.size:
                self._free[buf.dtype] = buf


_HOST_BUFFERS: weakref.WeakKeyDictionary[Any, HostBuffers] = weakref.WeakKeyDictionary()


def host_buffers(comm: Communicator) -> HostBuffers:
    """The reusable fused buffers of `comm`."""
    found = _HOST_BUFFERS.get(comm)
    if found is None:
        found = _HOST_BUFFERS[comm] = HostBuffers()
    return found


def pack_host(g: Group, fused: np.ndarray) -> None:
    """Copy each array of `g` into its place in `fused` (one copy each, straight from strided
    views)."""
    if g.contiguous:
        # one compiled call copies them all: a numpy call per array costs more than its copy
        from .kernels import copies

        copies.gather(fused, *host_table(g), fused.itemsize)
        return
    for host, dense, off, n in zip(g.hosts, g.dense, g.offsets, g.counts):
        seg = fused[off : off + n]
        if dense:
            seg[...] = host
        else:
            np.copyto(seg.reshape(host.shape), host)


def unpack_host(g: Group, fused: np.ndarray) -> None:
    """Copy each array's reduced segment of `fused` back into it (strided views included)."""
    if g.contiguous:
        from .kernels import copies

        copies.scatter(fused, *host_table(g), fused.itemsize)
        return
    for host, dense, off, n in zip(g.hosts, g.dense, g.offsets, g.counts):
        if dense:
            host[...] = fused[off : off + n]
        else:
            np.copyto(host, fused[off : off + n].reshape(host.shape))


def host_table(g: Group) -> tuple[np.ndarray, np.ndarray]:
    """(address, element count) of each array of a contiguous host group, as int64 arrays for
    the compiled copies; made once per call, for packing and unpacking alike."""
    if g.table is None:
        found = g.addresses
        addresses = (
            np.array(found, np.int64)
            if found is not None
            else np.fromiter(map(_address, g.hosts), np.int64, len(g.hosts))
        )
        g.table = (addresses, np.array(g.counts, np.int64))
    return g.table


# ---- device arrays ------------------------------------------------------------------------------


def device_layout(b: Buffer, what: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, strides in elements) of a device array."""
    obj = b.obj
    if b.kind == "torch":
        return tuple(obj.shape), tuple(int(s) for s in obj.stride())
    cai = obj.__cuda_array_interface__
    shape = tuple(int(n) for n in cai["shape"])
    strides = cai.get("strides")
    if strides is None:
        return shape, _c_strides(shape)
    if any(int(s) % b.itemsize for s in strides):
        raise InvalidArgument(
            f"{what}: strides {tuple(strides)} bytes are not whole elements of "
            f"{b.itemsize} bytes ({b.describe()})"
        )
    return shape, tuple(int(s) // b.itemsize for s in strides)


def _c_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def device_entries(g: Group) -> list[tuple[int, int, int, tuple[int, ...], tuple[int, ...]]]:
    """The rows of the pack/unpack table (hetcomm.kernels.fusion.table) for a device group."""
    return [
        (b.ptr, off, b.count, layout[0], layout[1])
        for b, off, layout in zip(g.bufs, g.offsets, g.layouts)
    ]


def check_device(what: str) -> None:
    """TransportUnavailable when device arrays cannot be fused in this process."""
    from .kernels import fusion

    why = fusion.unavailable()
    if why is not None:
        raise TransportUnavailable(f"{what} on device arrays: {why}")


def pack_device(g: Group) -> Any:
    """Pack a device group in one launch, ordered after the work queued on every array's
    current stream; returns the kernels' Packed (`.ptr`, `.unpack()`)."""
    from .kernels import device, fusion

    streams = list(device.by_stream(g.bufs))
    return fusion.shared().pack(
        device_entries(g), g.total, g.bufs[0].itemsize, g.device_index, streams
    )
