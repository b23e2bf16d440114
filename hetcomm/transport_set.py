"""TransportSet: the transports of one communicator, and which one serves each operation.

The plan (hetcomm.plan) chooses a transport per operation, memory kind and size class; the
choice is made once per class and each transport is made on its first use, on the
communicator it serves.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from . import plan as planning
from .arrays import Buffer
from .transports import registry
from .transports.base import Transport

if TYPE_CHECKING:
    from .comm import Communicator

log = logging.getLogger("hetcomm")


class TransportSet:
    """The transports `comm` has made (`live`, by name), the plan's choices, and why the plan
    may not pick each transport (`unavailable`, None where it may)."""

    def __init__(self, comm: Communicator, exclude: Mapping[str, str] | None = None) -> None:
        self._comm = comm
        self._classes: dict[str, type[Transport]] = registry()
        self.unavailable: dict[str, str | None] = {
            name: cls.unavailable(comm.topology) for name, cls in self._classes.items()
        }
        # transports this communicator must not use, with the reason the plan shows (the parts
        # of a hier transport exclude hier itself)
        self.unavailable.update(exclude or {})
        self.live: dict[str, Transport] = {}
        self._choices: dict[tuple[str, str, str], planning.Choice] = {}
        # (op, on a device, small) -> the transport: what a new route looks up
        self.by_class: dict[tuple[str, bool, bool], Transport] = {}

    def __iter__(self) -> Iterator[Transport]:
        return iter(list(self.live.values()))

    def for_op(self, op: str, buf: Buffer | None) -> Transport:
        """The transport of `op` on `buf`'s memory and size class (planned once per class)."""
        if buf is None:
            cls = (op, False, True)
        else:
            cls = (op, buf.device != "cpu", buf.count * buf.itemsize <= planning.SMALL_BYTES)
        found = self.by_class.get(cls)
        if found is None:
            found = self.by_class[cls] = self._resolve(op, buf)
        return found

    def _resolve(self, op: str, buf: Buffer | None) -> Transport:
        comm = self._comm
        memory = "device" if buf is not None and buf.on_device else "host"
        nbytes = buf.nbytes if buf is not None else 0
        key = (op, memory, planning.size_class(nbytes))
        choice = self._choices.get(key)
        if choice is None:
            choice = self._choices[key] = self.choose(
                op, memory, nbytes, comm.config.transport_for(comm.name)
            )
            log.info(
                "group '%s': %s on %s %s buffers -> %s (%s)",
                comm.name,
                op,
                key[2],
                memory,
                choice.transport,
                choice.reason,
            )
        return self.make(choice.transport)

    def choose(
        self,
        op: str,
        memory: str,
        nbytes: int,
        requested: str,
        exclude: Mapping[str, str] | None = None,
    ) -> planning.Choice:
        """The plan's choice for `op` on `nbytes` of `memory` (not kept), with the transports
        of `exclude` left out besides the unavailable ones."""
        comm = self._comm
        return planning.choose(
            comm.topology.members(),
            op=op,
            memory=memory,
            nbytes=nbytes,
            requested=requested,
            unavailable={**self.unavailable, **(exclude or {})},
            group=comm.name,
            direct_min=comm.config.direct_min,
        )

    def make(self, name: str) -> Transport:
        """Transport `name` of this communicator, made on first use."""
        transport = self.live.get(name)
        if transport is None:
            transport = self.live[name] = self._classes[name](self._comm)
        return transport

    def plan_table(self) -> planning.PlanTable:
        """The transport chosen for each operation, memory kind and size class, with reasons."""
        comm = self._comm
        return planning.plan_table(
            comm.topology.members(),
            requested=comm.config.transport_for(comm.name),
            unavailable=self.unavailable,
            group=comm.name,
            direct_min=comm.config.direct_min,
        )

    def close(self) -> None:
        """Close every transport made (each close is idempotent); none is made after."""
        for transport in self:
            transport.close()
        self.live.clear()
        self.by_class.clear()
