"""MpiStore, a torch Store over MPI, and the rendezvous that uses it (mpi://, env:// under mpirun).

A store is needed only by torch itself (and by gloo groups made beside hetcomm ones): under
mpirun `env://` without MASTER_ADDR/MASTER_PORT, and `mpi://` always, rendezvous over `MpiStore`,
a torch Store kept by rank 0 and reached over MPI (no network setup).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, cast
from urllib.parse import parse_qsl, urlparse

import torch.distributed as dist

from .work import _at_exit

# environment variables by which MPI launchers (Open MPI, MPICH/Hydra, Intel MPI, PMIx) mark a rank
_LAUNCHER_VARS = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE", "PMI_RANK", "MPI_LOCALNRANKS")

# ---- a torch Store over MPI ---------------------------------------------------------------------

_REQ, _REP = 7001, 7002  # tags on the store's own communicator
_StoreError: type[Exception] = getattr(dist, "DistStoreError", RuntimeError)


class MpiStore(dist.Store):
    """A torch key-value Store held by rank 0 of an MPI communicator and reached over MPI.

    Collective to create (it Dups `comm`, default COMM_WORLD); afterwards any rank may call any
    method at any time. Rank 0 serves requests from a daemon thread; values never touch a socket.
    """

    def __init__(self, comm: Any = None, timeout: timedelta = timedelta(minutes=5)) -> None:
        super().__init__()
        from mpi4py import MPI

        self._mpi = (MPI.COMM_WORLD if comm is None else comm).Dup()
        self._lock = threading.Lock()
        self._serial = 0
        self._server = _StoreServer(self._mpi) if self._mpi.Get_rank() == 0 else None
        self.set_timeout(timeout)

    def _call(self, op: str, *args: Any, timeout: timedelta | None = None) -> Any:
        limit = (timeout or cast(Any, self).timeout).total_seconds()
        with self._lock:
            self._serial += 1
            serial = self._serial
            self._mpi.send((serial, op, args, limit), dest=0, tag=_REQ)
            give_up = time.monotonic() + limit + 30.0  # the server answers timeouts itself
            sleep = 10e-6
            while True:
                msg = self._mpi.improbe(0, _REP)
                if msg is not None:
                    got, ok, value = msg.recv()
                    if got == serial:
                        break
                    continue  # the late answer to a request that timed out here
                if time.monotonic() > give_up:
                    raise _StoreError(
                        f"hetcomm MpiStore: {op} got no answer from rank 0 within "
                        f"{limit + 30:.0f} s"
                    )
                time.sleep(sleep)
                sleep = min(sleep * 2, 2e-3)
        if not ok:
            raise _StoreError(f"hetcomm MpiStore: {value}")
        return value

    def set(self, key: str, value: bytes | str) -> None:
        """Store `value` under `key` (torch's Store.set)."""
        self._call("set", key, _bytes(value))

    def get(self, key: str) -> bytes:
        """The value of `key`, waiting for it within the store's timeout (Store.get)."""
        return self._call("get", key)

    def add(self, key: str, amount: int) -> int:
        """Add `amount` to the counter `key` and return its new value (Store.add)."""
        return self._call("add", key, int(amount))

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        """Set `key` to `desired` if it holds `expected`; the value it then holds."""
        return self._call("compare_set", key, _bytes(expected), _bytes(desired))

    def append(self, key: str, value: bytes | str) -> None:
        """Append `value` to the value of `key` (Store.append)."""
        self._call("append", key, _bytes(value))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """The values of `keys`, in order (Store.multi_get)."""
        return self._call("multi_get", list(keys))

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        """Store each value under its key (Store.multi_set)."""
        self._call("multi_set", list(keys), [_bytes(v) for v in values])

    def check(self, keys: list[str]) -> bool:
        """Whether every key of `keys` is set, without waiting (Store.check)."""
        return self._call("check", list(keys))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Wait until every key of `keys` is set, within `timeout` (Store.wait)."""
        self._call("wait", list(keys), timeout=timeout)

    def getNumKeys(self) -> int:
        """How many keys are set (also `num_keys`)."""
        return self._call("num_keys")

    def deleteKey(self, key: str) -> bool:
        """Remove `key`; whether it was there (also `delete_key`)."""
        return self._call("delete_key", key)

    num_keys = getNumKeys
    delete_key = deleteKey

    def has_extended_api(self) -> bool:
        """True: append, multi_get and multi_set are implemented."""
        return True

    def clone(self) -> MpiStore:
        """This store itself: it serves one request at a time per process, from any thread."""
        return self  # thread-safe: one request at a time per process


def _bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class _StoreServer:
    """Rank 0's side of MpiStore: the data, requests that wait for keys, a polling thread."""

    def __init__(self, mpi: Any) -> None:
        self._mpi = mpi
        self._data: dict[str, bytes] = {}
        self._parked: list[tuple[float, int, int, str, list[str]]] = []
        self._sends: list[Any] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="hetcomm-store", daemon=True)
        self._thread.start()
        _at_exit(self.close)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _serve(self) -> None:
        from mpi4py import MPI

        status = MPI.Status()
        sleep = 10e-6
        while not self._stop.is_set():
            msg = self._mpi.improbe(MPI.ANY_SOURCE, _REQ, status)
            if msg is None:
                self._housekeeping()
                time.sleep(sleep)
                sleep = min(sleep * 2, 5e-3)
                continue
            sleep = 10e-6
            serial, op, args, limit = msg.recv()
            try:
                self._handle(status.Get_source(), serial, op, args, limit)
            except Exception as exc:  # a malformed request must not end the server
                self._reply(status.Get_source(), serial, False, f"{op}: {exc}")

    def _handle(self, src: int, serial: int, op: str, args: tuple, limit: float) -> None:
        data = self._data
        if op in ("get", "wait", "multi_get"):
            keys = [args[0]] if op == "get" else list(args[0])
            if all(k in data for k in keys):
                self._answer_wait(src, serial, op, keys)
            else:
                self._parked.append((time.monotonic() + limit, src, serial, op, keys))
            return
        value: Any = None
        if op == "set":
            data[args[0]] = args[1]
        elif op == "add":
            value = int(data.get(args[0], b"0")) + args[1]
            data[args[0]] = str(value).encode()
        elif op == "append":
            data[args[0]] = data.get(args[0], b"") + args[1]
        elif op == "multi_set":
            data.update(zip(args[0], args[1]))
        elif op == "compare_set":
            key, expected, desired = args
            current = data.get(key)
            if (current is None and not expected) or current == expected:
                data[key] = value = desired
            else:
                value = expected if current is None else current
        elif op == "check":
            value = all(k in data for k in args[0])
        elif op == "num_keys":
            value = len(data)
        elif op == "delete_key":
            value = data.pop(args[0], None) is not None
        else:
            raise ValueError(f"unknown store operation {op!r}")
        self._reply(src, serial, True, value)
        if self._parked:
            self._wake()

    def _answer_wait(self, src: int, serial: int, op: str, keys: list[str]) -> None:
        data = self._data
        value: Any = (
            data[keys[0]] if op == "get" else [data[k] for k in keys] if op == "multi_get" else None
        )
        self._reply(src, serial, True, value)

    def _wake(self) -> None:
        still = []
        for entry in self._parked:
            _, src, serial, op, keys = entry
            if all(k in self._data for k in keys):
                self._answer_wait(src, serial, op, keys)
            else:
                still.append(entry)
        self._parked = still

    def _housekeeping(self) -> None:
        if self._parked:
            now = time.monotonic()
            for _, src, serial, op, keys in [e for e in self._parked if e[0] < now]:
                missing = [k for k in keys if k not in self._data]
                self._reply(src, serial, False, f"{op}: timed out waiting for keys {missing}")
            self._parked = [e for e in self._parked if e[0] >= now]
        if self._sends:
            self._sends = [r for r in self._sends if not r.Test()]

    def _reply(self, dst: int, serial: int, ok: bool, value: Any) -> None:
        self._sends.append(self._mpi.isend((serial, ok, value), dest=dst, tag=_REP))


# ---- rendezvous: env:// under mpirun, and mpi:// ------------------------------------------------


class _Rendezvous:
    store: MpiStore | None = None  # made by the first rendezvous, shared by later ones
    count = 0  # rendezvous so far: each gets its own key prefix


def _launched_by_mpi() -> bool:
    return any(os.environ.get(v) for v in _LAUNCHER_VARS)


def _mpi_rendezvous(
    url: str, timeout: timedelta = timedelta(minutes=30), **kwargs: Any
) -> Iterator[tuple[Any, int, int]]:
    """mpi:// (and env:// without MASTER_ADDR under mpirun): rank and size from MPI.COMM_WORLD."""
    from mpi4py import MPI

    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    query = dict(parse_qsl(urlparse(url).query))
    for name, mine in (("rank", rank), ("world_size", size)):
        given = int(query.get(name, -1))
        if given not in (-1, mine):
            raise ValueError(
                f"hetcomm rendezvous: {name}={given} was given, but MPI says {mine}; under "
                "mpirun leave rank and world_size out (they come from MPI) or make them match"
            )
    if size == 1:
        store: Any = dist.HashStore()
    else:
        if _Rendezvous.store is None:
            _Rendezvous.store = MpiStore(timeout=timeout)
        # each rendezvous gets fresh keys, so that a second init_process_group in the same job
        # never reads what the first one wrote
        _Rendezvous.count += 1
        store = dist.PrefixStore(f"hetcomm-rdzv{_Rendezvous.count}", _Rendezvous.store)
    store.set_timeout(timeout)
    yield store, rank, size
    raise RuntimeError("hetcomm rendezvous: re-rendezvous is not supported")


def _env_or_mpi(original: Callable[..., Iterator[tuple[Any, int, int]]]) -> Callable[..., Any]:
    def handler(url: str, **kwargs: Any) -> Iterator[tuple[Any, int, int]]:
        if _launched_by_mpi() and not (
            os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")
        ):
            return _mpi_rendezvous(url, **kwargs)
        return original(url, **kwargs)

    handler.hetcomm_wraps = original  # type: ignore[attr-defined]
    return handler
