"""Receives on the mpi transport: the MPI requests of one hetcomm receive, polled, and the
size check that turns a message of another size into MismatchError naming both."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mpi4py import MPI

from ...errors import MismatchError

if TYPE_CHECKING:
    from ...work import Work


class Receive:
    """A receive that checks the size of what arrived: a sender of another size raises
    MismatchError naming both sizes (MPI itself accepts a shorter message silently and fails a
    longer one with MPI_ERR_TRUNCATE). The data goes straight into the caller's array, so on a
    mismatch it may hold the first part of the message; probing each message first would keep
    it untouched, at the price of posting every receive late (measured: slower).

    `src` < 0 (hetcomm.ANY_SOURCE): the requests were posted with MPI.ANY_SOURCE; the status
    names the sender, which the Work (`work`, when set) carries as `source` on completion."""

    def __init__(
        self,
        src: int,
        nbytes: int,
        itemsize: int,
        reqs: list[MPI.Request],
        spans: list[tuple[int, int]],
    ) -> None:
        self.src, self.nbytes, self.itemsize = src, nbytes, itemsize
        self.reqs = reqs
        self.spans = spans
        self.statuses = [MPI.Status() for _ in spans]
        self.work: Work | None = None
        self._later: tuple[MPI.Intracomm, MPI.Datatype, int, list[Any]] | None = None

    def then_from_sender(
        self, mpi: MPI.Intracomm, dt: MPI.Datatype, tag: int, pieces: list[Any]
    ) -> None:
        """Post `pieces` from the sender of the first piece, once it has matched."""
        self._later = (mpi, dt, tag, pieces)

    def poll(self) -> bool:
        """True once every piece has landed, each of the size this receive takes."""
        try:
            statuses = self.statuses[: len(self.reqs)]
            if not MPI.Request.Testall(self.reqs, statuses):
                return False
            if self.src < 0:
                self.src = statuses[0].Get_source()
                if self._later is not None:
                    mpi, dt, tag, pieces = self._later
                    self._later = None
                    self.reqs += [mpi.Irecv((piece, dt), self.src, tag) for piece in pieces]
                    return self.poll()
        except MPI.Exception as exc:
            # one request fails with ERR_TRUNCATE; Testall says ERR_IN_STATUS and the status
            # holds the reason
            errors = {
                exc.Get_error_class(),
                *(MPI.Get_error_class(st.Get_error()) for st in self.statuses),
            }
            if MPI.ERR_TRUNCATE not in errors:
                raise
            raise _truncated(self.src, self.nbytes) from None
        for (_, n), status in zip(self.spans, self.statuses):
            got = status.Get_count(MPI.BYTE)
            if got != n * self.itemsize:
                sent = got if len(self.spans) == 1 else f"a piece of {got}"
                raise _other_size(self.src, sent, n * self.itemsize)
        if self.work is not None:
            self.work.source = self.src
        return True


class OneReceive:
    """A receive of one MPI call (any receive below MAX_CALL_BYTES), checked as Receive
    checks its pieces, at a third of its cost per call: one request, one status, no lists."""

    __slots__ = ("nbytes", "request", "src", "status", "work")

    def __init__(self, request: MPI.Request, src: int, nbytes: int) -> None:
        self.request, self.src, self.nbytes = request, src, nbytes
        self.status = MPI.Status()
        self.work: Work | None = None

    def poll(self) -> bool:
        """True once the message has landed, of the size this receive takes."""
        status = self.status
        try:
            if not self.request.Test(status):
                return False
        except MPI.Exception as exc:
            if MPI.ERR_TRUNCATE not in (
                exc.Get_error_class(),
                MPI.Get_error_class(status.Get_error()),
            ):
                raise
            if self.src < 0 and status.Get_source() >= 0:
                self.src = status.Get_source()  # the status names the sender all the same
            raise _truncated(self.src, self.nbytes) from None
        if self.src < 0:
            self.src = status.Get_source()
        got = status.Get_count(MPI.BYTE)
        if got != self.nbytes:
            raise _other_size(self.src, got, self.nbytes)
        if self.work is not None:
            self.work.source = self.src
        return True


def _sender(src: int) -> str:
    return f"rank {src}" if src >= 0 else "any source"


def _other_size(src: int, sent: object, takes: int) -> MismatchError:
    return MismatchError(
        f"receive from {_sender(src)}: the sender has {sent} bytes, this receive takes {takes}"
    )


def _truncated(src: int, nbytes: int) -> MismatchError:
    return MismatchError(
        f"receive from {_sender(src)}: the sender has more than "
        f"{nbytes} bytes, this receive takes {nbytes}"
    )
