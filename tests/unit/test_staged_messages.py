"""A finished receive leaves the transport's receives by its own key: the receives are shared
with the other driver threads, which add theirs meanwhile, so it is never found by a scan."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from hetcomm.transports.local import Region
from hetcomm.transports.staged.messages import Messages


class _NoScans(dict[int, Any]):
    """The transport's receives, failing any walk over them (keys, values or items)."""

    def __iter__(self) -> Any:
        raise AssertionError("the receives were walked")

    def items(self) -> Any:
        raise AssertionError("the receives were walked")

    def keys(self) -> Any:
        raise AssertionError("the receives were walked")

    def values(self) -> Any:
        raise AssertionError("the receives were walked")


class _Cts:
    def __init__(self) -> None:
        self.sent: list[tuple[int, ...]] = []

    def send(self, *args: int) -> None:
        self.sent.append(args)


class _Transport:
    """What Messages.post_recv and forget use of a StagedTransport: receives from this very
    rank (no channel)."""

    rank = 0
    chunk_bytes = 64

    def __init__(self) -> None:
        self.receives = _NoScans()
        self._op_ids = itertools.count(1)
        self.cts = _Cts()


def test_a_finished_receive_leaves_by_its_own_key() -> None:
    t = _Transport()
    messages = Messages(t)  # type: ignore[arg-type]
    rng = np.random.default_rng()
    sizes = rng.integers(1, 300, 3)
    ops = [
        messages.post_recv(0, Region(int(n), np.zeros(int(n), np.uint8)), 2, 5, step, 1e9)
        for step, n in enumerate(sizes)
    ]
    keys = [op.key for op in ops]
    assert len(set(keys)) == 3 and all(
        dict.__getitem__(t.receives, k) is op for k, op in zip(keys, ops, strict=True)
    )
    # each clear-to-send names the receive's key and its size
    assert [(s[4], s[5]) for s in t.cts.sent] == [
        (k, int(n)) for k, n in zip(keys, sizes, strict=True)
    ]
    messages.forget(ops[1])
    assert sorted(dict.keys(t.receives)) == [keys[0], keys[2]]
    messages.forget(ops[1])  # forgetting twice is harmless
    for op in (ops[0], ops[2]):
        messages.forget(op)
    assert dict.__len__(t.receives) == 0
