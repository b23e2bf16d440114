"""The torch layer's blocking calls: a call torch waits for at once (asyncOp=False, what every
`dist.<op>` without async_op passes) runs as the Communicator's blocking call and returns None,
which torch's own functions take as a completed call; the same call with asyncOp=True returns a
Work. Every collective form of the group, called as torch's functions call it, with results
checked against numpy."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch._C._distributed_c10d as c10d
import torch.distributed as dist

pytestmark = pytest.mark.mpi(min_size=2)

FORMS = (
    "allreduce",
    "broadcast",
    "reduce",
    "allgather",
    "all_gather_single",
    "reduce_scatter_single",
    "all_to_all_single",
    "barrier",
)


def options(kind: str, blocking: bool, **fields: Any) -> Any:
    opts = getattr(c10d, kind)()
    opts.asyncOp = not blocking
    for name, value in fields.items():
        setattr(opts, name, value)
    return opts


def forms(n: int, me: int, stack: np.ndarray) -> dict[str, tuple[Callable[..., Any], Callable]]:
    """op -> (call(pg, blocking), check() -> what is wrong or None), on fresh tensors.
    `stack[r]`: rank r's input (n blocks of 2 elements)."""
    mine = torch.from_numpy(stack[me].copy())
    x = mine.clone()
    out = torch.empty(n * mine.numel(), dtype=mine.dtype)
    part = torch.empty(2, dtype=mine.dtype)
    outs = [torch.empty_like(mine) for _ in range(n)]
    total = stack.sum(axis=0)
    sum_ = dist.ReduceOp.SUM

    def same(got: torch.Tensor, want: np.ndarray) -> bool:
        return np.array_equal(got.numpy().reshape(want.shape), want)

    return {
        "allreduce": (
            lambda pg, b: pg.allreduce([x], options("AllreduceOptions", b, reduceOp=sum_)),
            lambda: same(x, total),
        ),
        "broadcast": (
            lambda pg, b: pg.broadcast([x], options("BroadcastOptions", b, rootRank=n - 1)),
            lambda: same(x, stack[n - 1]),
        ),
        "reduce": (
            lambda pg, b: pg.reduce([x], options("ReduceOptions", b, rootRank=0, reduceOp=sum_)),
            lambda: same(x, total if me == 0 else stack[me]),
        ),
        "allgather": (
            lambda pg, b: pg.allgather([outs], [x], options("AllgatherOptions", b)),
            lambda: all(same(o, stack[r]) for r, o in enumerate(outs)),
        ),
        "all_gather_single": (
            lambda pg, b: pg.all_gather_single(out, x, options("AllgatherOptions", b)),
            lambda: same(out, stack),
        ),
        "reduce_scatter_single": (
            lambda pg, b: pg.reduce_scatter_single(
                part, x, options("ReduceScatterOptions", b, reduceOp=sum_)
            ),
            lambda: same(part, total.reshape(n, 2)[me]),
        ),
        "all_to_all_single": (
            lambda pg, b: pg.all_to_all_single(
                out[: x.numel()], x, None, None, options("AllToAllOptions", b)
            ),
            lambda: same(out[: x.numel()], stack.reshape(n, n, 2)[:, me]),
        ),
        "barrier": (lambda pg, b: pg.barrier(options("BarrierOptions", b)), lambda: True),
    }


@pytest.mark.usefixtures("pg")
@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "async"])
def test_every_form_blocking_returns_none_async_a_work(rng, errors, blocking: bool) -> None:
    from hetcomm.torch import ProcessGroupHetcomm

    pg = dist.group.WORLD
    assert isinstance(pg, ProcessGroupHetcomm)
    n, me = dist.get_world_size(), dist.get_rank()
    for op in FORMS:
        stack = rng.integers(-50, 50, (n, 2 * n)).astype(np.float64)
        call, check = forms(n, me, stack)[op]
        work = call(pg, blocking)
        if blocking:
            errors.expect(work is None, f"{op} blocking returned {work!r}")
        else:
            errors.expect(isinstance(work, dist.Work), f"{op} async returned {work!r}")
            if work is not None:
                work.wait()
        errors.expect(check(), f"{op} ({'blocking' if blocking else 'async'}): wrong result")
    errors.verify()
