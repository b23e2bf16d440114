"""What `hetcomm bench` times: one case (inputs and the expected result, in float64) and the
implementations that run it, hetcomm's transports and the baselines (raw mpi4py, naive staging,
torch gloo, torch NCCL)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .report import REDUCING


def torch_gloo(mpi: Any) -> Any:
    """torch.distributed with gloo over loopback, rendezvous address agreed over MPI."""
    import torch.distributed as dist

    # the server listens before any client learns its port: no port chosen ahead can be taken
    rank, size = mpi.Get_rank(), mpi.Get_size()
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, size, True, wait_for_workers=False, use_libuv=False)
        mpi.bcast(store.port, root=0)
    else:
        store = dist.TCPStore("127.0.0.1", mpi.bcast(None, root=0), size, False, use_libuv=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size)
    return dist


_MPI_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "float32", "float64")  # + bool: no redop
_TOLERANCE = {"float16": 2e-3, "bfloat16": 1e-2, "float32": 1e-6, "float64": 1e-12}


class Skip(Exception):
    """This implementation cannot run this op here; the message says why."""


class Case:
    """One op at one size: every rank's inputs and this rank's expected output, in float64."""

    def __init__(
        self, op: str, count: int, dtype: str, redop: str, root: int, rank: int, ranks: int
    ) -> None:
        self.op, self.count, self.dtype, self.redop = op, count, dtype, redop
        self.root, self.rank, self.ranks = root, rank, ranks
        blocked = op == "all_gather"
        self.in_count = count // ranks if blocked else count
        self.out_count = count // ranks if op == "reduce_scatter" else count

    def input(self, r: int) -> np.ndarray:
        i = np.arange(self.in_count, dtype=np.int64)
        if self.dtype == "bool":
            return ((i + r) % 2).astype(np.float64)
        if self.redop == "prod":  # small factors: no overflow in int8 or float16
            return ((i + r) % 2 + 1).astype(np.float64)
        return ((i * 3 + r * 7) % 7 + 1).astype(np.float64)

    def expected(self) -> np.ndarray | None:
        """This rank's correct output (None where the op defines none, as reduce off the root)."""
        op, n, r = self.op, self.ranks, self.rank
        if op == "broadcast":
            return self.input(self.root)
        if op == "sendrecv":
            return self.input((r - 1) % n)
        if op == "all_gather":
            return np.concatenate([self.input(q) for q in range(n)])
        if op == "all_to_all":
            b = self.count // n
            return np.concatenate([self.input(q)[r * b : (r + 1) * b] for q in range(n)])
        if op == "reduce" and r != self.root:
            return None
        stack = np.stack([self.input(q) for q in range(n)])
        fn: dict[str, Callable[..., Any]] = {
            "sum": np.sum,
            "prod": np.prod,
            "min": np.min,
            "max": np.max,
            "avg": np.mean,
        }
        out = fn[self.redop](stack, axis=0)
        if self.dtype == "bool":
            out = (out != 0).astype(np.float64)
        if op == "reduce_scatter":
            b = self.out_count
            out = out[r * b : (r + 1) * b]
        return np.asarray(out, dtype=np.float64)

    def wrong(self, got: Any) -> int:
        """Elements of `got` (a tensor or array) that differ from expected()."""
        want = self.expected()
        if want is None:
            return 0
        g = as_float64(got)
        if self.dtype == "bool":
            return int(np.count_nonzero((g != 0) != (want != 0)))
        if self.dtype in _TOLERANCE:
            ok = np.isclose(g, want, rtol=_TOLERANCE[self.dtype], atol=0)
        else:  # integers: exact, but an integer average may round either way
            ok = np.abs(g - want) <= (1 if self.redop == "avg" else 0)
        return int(g.size - np.count_nonzero(ok))


def as_float64(x: Any) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x.astype(np.float64).ravel()
    import torch

    return x.detach().to("cpu", torch.float64).numpy().ravel()


def to_tensor(values: np.ndarray, dtype: str, device: str) -> Any:
    import torch

    return torch.from_numpy(values).to(getattr(torch, dtype)).to(device)


class Impl:
    """One way of running the ops: `prepare` gives (call, output) for a case in one form or
    raises Skip. In place, `x` and `y` are the one buffer the op works in (for all_gather, `x`
    is this rank's block of `y`; for reduce_scatter, `y` is this rank's block of `x`)."""

    name = ""
    kind = "baseline"
    on_device = True  # buffers on the benchmark's device (else on the host)

    def prepare(
        self, case: Case, x: Any, y: Any, in_place: bool = False
    ) -> tuple[Callable[[], Any], Any]:
        raise NotImplementedError

    def close(self) -> None:
        pass


class Hetcomm(Impl):
    """A hetcomm Communicator with one transport (Config(transport=...))."""

    kind = "hetcomm"

    def __init__(self, transport: str) -> None:
        import hetcomm

        self.name = transport
        self.comm = hetcomm.init(config=hetcomm.Config.load(transport=transport), name="bench")

    def prepare(
        self, case: Case, x: Any, y: Any, in_place: bool = False
    ) -> tuple[Callable[[], Any], Any]:
        c, op, red, root = self.comm, case.op, case.redop, case.root
        if op == "all_reduce":
            if in_place:
                return (lambda: c.all_reduce(x, red)), x
            return (lambda: c.all_reduce(x, red, out=y)), y
        if op == "all_gather":  # in place, x is this rank's block of y
            return (lambda: c.all_gather(y, x)), y
        if op == "reduce_scatter":  # in place, y is this rank's block of x
            return (lambda: c.reduce_scatter(y, x, red)), y
        if op == "all_to_all":
            if in_place:
                return (lambda: c.all_to_all(x, x)), x
            return (lambda: c.all_to_all(y, x)), y
        if op == "sendrecv":
            if in_place:
                raise Skip("no in-place send/recv: one buffer both sent and received into")
            return self._sendrecv(x, y)
        if not in_place:
            raise Skip(f"hetcomm's {op} has no out-of-place form")
        if op == "broadcast":
            return (lambda: c.broadcast(x, root)), x
        return (lambda: c.reduce(x, root, red)), x

    def _sendrecv(self, x: Any, y: Any) -> tuple[Callable[[], Any], Any]:
        """Send to rank+1 and receive from rank-1 at once (the sweep's sendrecv)."""
        c = self.comm
        dst, src = (c.rank + 1) % c.size, (c.rank - 1) % c.size

        def sendrecv() -> None:
            s = c.send(x, dst, async_op=True)
            r = c.recv(y, src, async_op=True)
            assert s is not None and r is not None
            r.wait()
            s.wait()

        return sendrecv, y

    def close(self) -> None:
        self.comm.close()


def _mpi_dtype(case: Case) -> None:
    if case.dtype not in _MPI_DTYPES and not (case.dtype == "bool" and case.op not in REDUCING):
        raise Skip(f"no MPI datatype for {case.dtype} here")


def _mpi_call(
    raw: Any, case: Case, a: np.ndarray, b: np.ndarray, in_place: bool = False
) -> tuple[Callable[[], Any], np.ndarray]:
    """The raw mpi4py call of `case` from numpy `a` into numpy `b`, and the array that holds
    the result. In place: MPI.IN_PLACE where MPI has it, Sendrecv_replace for sendrecv."""
    from mpi4py import MPI

    _mpi_dtype(case)
    ops = {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX}
    if case.op in REDUCING and case.redop not in ops:
        raise Skip(f"MPI has no {case.redop} reduction")
    mop, root, n, me = ops.get(case.redop, MPI.SUM), case.root, raw.Get_size(), raw.Get_rank()
    op, here = case.op, MPI.IN_PLACE
    if op == "broadcast":
        if not in_place:
            raise Skip("MPI_Bcast works in place only")
        return (lambda: raw.Bcast(a, root=root)), a
    dst, src = (me + 1) % n, (me - 1) % n
    if in_place:
        if op == "all_reduce":
            return (lambda: raw.Allreduce(here, a, op=mop)), a
        if op == "all_gather":  # b is the whole output, a its block
            return (lambda: raw.Allgather(here, b)), b
        if op == "reduce_scatter":  # MPI leaves the result in the first block of a
            return (lambda: raw.Reduce_scatter_block(here, a, op=mop)), a[: b.size]
        if op == "all_to_all":
            return (lambda: raw.Alltoall(here, a)), a
        if op == "reduce":
            if me == root:
                return (lambda: raw.Reduce(here, a, op=mop, root=root)), a
            return (lambda: raw.Reduce(a, None, op=mop, root=root)), a
        return (lambda: raw.Sendrecv_replace(a, dst, 0, src, 0)), a
    if op == "all_reduce":
        return (lambda: raw.Allreduce(a, b, op=mop)), b
    if op == "all_gather":
        return (lambda: raw.Allgather(a, b)), b
    if op == "reduce_scatter":
        return (lambda: raw.Reduce_scatter_block(a, b, op=mop)), b
    if op == "all_to_all":
        return (lambda: raw.Alltoall(a, b)), b
    if op == "reduce":
        return (lambda: raw.Reduce(a, b, op=mop, root=root)), b
    return (lambda: raw.Sendrecv(a, dst, 0, b, src, 0)), b


class _OnMpi(Impl):
    """A baseline that calls MPI itself, on the communicator `raw`."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw


class Mpi4py(_OnMpi):
    """Raw mpi4py collectives on numpy arrays (host memory, whatever --device says)."""

    name = "mpi4py"
    on_device = False

    def prepare(
        self, case: Case, x: Any, y: Any, in_place: bool = False
    ) -> tuple[Callable[[], Any], Any]:
        _mpi_dtype(case)
        return _mpi_call(self.raw, case, x.numpy(), y.numpy(), in_place)


class Naive(_OnMpi):
    """Copy device->host (pageable), MPI on the host copy, copy the result back."""

    name = "naive"

    def prepare(
        self, case: Case, x: Any, y: Any, in_place: bool = False
    ) -> tuple[Callable[[], Any], Any]:
        import torch

        _mpi_dtype(case)
        if in_place and case.op in ("all_gather", "reduce_scatter"):
            raise Skip("naive staging runs these out of place only")
        hx = np.empty(x.shape, _np_dtype(case.dtype))
        hy = hx if in_place else np.empty(y.shape, _np_dtype(case.dtype))
        mpi, result = _mpi_call(self.raw, case, hx, hy, in_place)
        out = x if result is hx else y

        def naive() -> None:
            hx[...] = x.to("cpu").numpy()  # device -> pageable host (a numpy copy on the CPU)
            mpi()
            out.copy_(torch.from_numpy(result))

        return naive, out


def _np_dtype(dtype: str) -> Any:
    return np.bool_ if dtype == "bool" else np.dtype(dtype)


class Gloo(Impl):
    """torch.distributed with gloo, rendezvous on 127.0.0.1 (port chosen by rank 0, over MPI)."""

    name = "gloo"

    def __init__(self, raw: Any) -> None:
        import torch.distributed as dist

        self.own = not dist.is_initialized()
        self.dist = torch_gloo(raw) if self.own else dist
        self.size, self.rank = raw.Get_size(), raw.Get_rank()
        self.group: Any = None  # the default group

    def prepare(
        self, case: Case, x: Any, y: Any, in_place: bool = False
    ) -> tuple[Callable[[], Any], Any]:
        op, root, g = case.op, case.root, self.group
        dist = _InGroup(self.dist, g)
        ops = {
            "sum": dist.ReduceOp.SUM,
            "prod": dist.ReduceOp.PRODUCT,
            "min": dist.ReduceOp.MIN,
            "max": dist.ReduceOp.MAX,
        }
        if op in REDUCING and case.redop not in ops:
            raise Skip(f"{self.name} has no {case.redop} reduction")
        red = ops.get(case.redop, dist.ReduceOp.SUM)
        gather = _dist_fn(self.dist, "all_gather_single", "all_gather_into_tensor")
        scatter = _dist_fn(self.dist, "reduce_scatter_single", "reduce_scatter_tensor")
        if op == "all_gather":  # in place, x is this rank's block of y
            return (lambda: dist.call(gather, y, x)), y
        if op == "reduce_scatter":  # in place, y is this rank's block of x
            return (lambda: dist.call(scatter, y, x, red)), y
        if op == "all_to_all" and not in_place:
            return (lambda: dist.all_to_all_single(y, x)), y
        if op in ("all_reduce", "broadcast", "reduce") and not in_place:
            raise Skip(f"torch's {op} works in place only")
        if op == "all_reduce":
            return (lambda: dist.all_reduce(x, red)), x
        if op == "broadcast":
            return (lambda: dist.broadcast(x, src=root)), x
        if op == "reduce":
            return (lambda: dist.reduce(x, dst=root, op=red)), x
        if in_place:
            raise Skip(f"torch has no in-place {op}")
        dst, src = (self.rank + 1) % self.size, (self.rank - 1) % self.size

        def sendrecv() -> None:
            s = dist.isend(x, dst)
            r = dist.irecv(y, src)
            r.wait()
            s.wait()

        return sendrecv, y

    def close(self) -> None:
        if self.own:
            self.dist.destroy_process_group()


class _InGroup:
    """torch.distributed's calls with `group=` filled in."""

    def __init__(self, dist: Any, group: Any) -> None:
        self._dist, self._group = dist, group
        self.ReduceOp = dist.ReduceOp

    def __getattr__(self, name: str) -> Callable[..., Any]:
        fn = getattr(self._dist, name)
        return lambda *a, **k: fn(*a, group=self._group, **k)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args, group=self._group)


def _dist_fn(dist: Any, *names: str) -> Callable[..., Any]:
    """The first of `names` this torch.distributed has (torch 2.13 renamed some)."""
    for name in names:
        fn = getattr(dist, name, None)
        if fn is not None:
            return fn
    raise Skip(f"this torch has none of {', '.join(names)}")


class TorchNccl(Gloo):
    """NCCL through torch.distributed (a group beside gloo's default group): the baseline where
    every rank has a GPU of its own; NCCL refuses two ranks on one GPU."""

    name = "nccl"

    def __init__(self, raw: Any) -> None:
        import torch
        from mpi4py import MPI

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        local = raw.Split_type(MPI.COMM_TYPE_SHARED)
        sharing = local.Get_size()
        local.Free()
        if gpus == 0:
            raise RuntimeError("no CUDA device: NCCL moves CUDA tensors only")
        if sharing > gpus:
            raise RuntimeError(
                f"{sharing} ranks share {gpus} GPU(s) on this host; NCCL needs "
                "a GPU of its own per rank"
            )
        super().__init__(raw)
        self.group = self.dist.new_group(backend="nccl")
