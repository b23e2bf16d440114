"""Used on the ranks by the scenarios of test_hier.py: data, sentinels, references, checks."""

from __future__ import annotations

import functools
import json
from typing import Any

import numpy as np

from hetcomm import ReduceOp


def world() -> Any:
    """MPI.COMM_WORLD, imported on the ranks only (the test process never initialises MPI)."""
    from mpi4py import MPI

    return MPI.COMM_WORLD


def my_rank() -> int:
    """This rank in MPI.COMM_WORLD."""
    return int(world().Get_rank())


OPS = tuple(ReduceOp)


INTS = ("int8", "int32", "int64", "uint8")


FLOATS = ("float16", "bfloat16", "float32", "float64")


# relative error allowed per rank taking part (see `check`)
EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-22, "float64": 2.0**-50}


PAD = 3  # sentinel elements on each side of every output


@functools.cache
def torch() -> Any:
    """torch, imported by the jobs that use bfloat16 only (numpy has none): it is slow to load."""
    import torch

    return torch


def report(**result: Any) -> None:
    print("RESULT " + json.dumps({"rank": my_rank(), **result}), flush=True)


def draw(rng: np.random.Generator, dtype: str, n: int, count: int) -> np.ndarray:
    """Logical inputs of all n ranks (float64; int64; bool), exact in `dtype`; products of n
    of them stay in range."""
    if dtype == "bool":
        return rng.random((n, count)) < 0.6
    if dtype in INTS:
        info = np.iinfo(dtype)
        hi = max(1, min(1000, int(float(info.max) ** (1.0 / n))))
        return rng.integers(0 if info.min == 0 else -hi, hi, (n, count), endpoint=True)
    values = rng.uniform(0.5, 2.0, (n, count)) * rng.choice([-1.0, 1.0], (n, count))
    if dtype == "bfloat16":
        return torch().from_numpy(values).to(torch().bfloat16).to(torch().float64).numpy()
    return values.astype(dtype).astype(np.float64)


def sentinel(dtype: str) -> Any:
    return True if dtype == "bool" else (177 if dtype == "uint8" else -77)


def array(values: np.ndarray, dtype: str) -> Any:
    """numpy for every dtype numpy has, a torch CPU tensor for bfloat16."""
    if dtype == "bfloat16":
        t = torch()
        return t.from_numpy(np.array(values, dtype=np.float64)).to(t.bfloat16)
    return np.array(values, dtype=dtype)


def logical(arr: Any) -> np.ndarray:
    if not isinstance(arr, np.ndarray):  # a torch tensor
        return arr.to(torch().float64).numpy()
    a = np.asarray(arr)
    return (
        a.copy()
        if a.dtype == np.bool_
        else a.astype(np.float64 if a.dtype.kind == "f" else np.int64)
    )


def raw(arr: Any) -> bytes:
    """The bits of an array (for the bitwise comparison across ranks)."""
    if not isinstance(arr, np.ndarray):  # a torch tensor
        return arr.view(torch().int16).numpy().tobytes()
    return np.ascontiguousarray(arr).tobytes()


class Placed:
    """An output array inside a backing array of sentinels: intact() checks nothing else moved."""

    def __init__(self, values: np.ndarray, dtype: str) -> None:
        self.n = values.size
        self.sentinel = sentinel(dtype)
        self.backing = array(np.full(self.n + 2 * PAD, self.sentinel), dtype)
        self.array = self.backing[PAD : PAD + self.n]
        self.array[...] = array(values, dtype)

    def intact(self) -> bool:
        b = logical(self.backing)
        return bool((b[:PAD] == self.sentinel).all() and (b[PAD + self.n :] == self.sentinel).all())


def reference(stack: np.ndarray, op: ReduceOp, dtype: str) -> np.ndarray:
    """The reduction over the ranks (axis 0), in float64 / int64 / bool."""
    if dtype == "bool":
        return stack.any(axis=0) if op in (ReduceOp.SUM, ReduceOp.MAX) else stack.all(axis=0)
    if op is ReduceOp.MIN:
        return stack.min(axis=0)
    if op is ReduceOp.MAX:
        return stack.max(axis=0)
    if op is ReduceOp.PROD:
        return stack.prod(axis=0)
    total = stack.sum(axis=0)
    if op is ReduceOp.AVG:
        return np.trunc(total / len(stack)) if dtype in INTS else total / len(stack)
    return total


def check(
    got: np.ndarray, stack: np.ndarray, op: ReduceOp | None, dtype: str, what: str
) -> list[str]:
    """[] when `got` matches the reduction of `stack` (op None: `stack` itself is expected).

    Float SUM, AVG and PROD round at each step: |error| <= n * eps * scale, scale being the
    sum of magnitudes (its average for AVG) or the product's magnitude."""
    want = stack if op is None else reference(stack, op, dtype)
    if got.shape != want.shape:
        return [f"{what}: shape {got.shape}, expected {want.shape}"]
    if op is None or dtype not in FLOATS or op in (ReduceOp.MIN, ReduceOp.MAX):
        bad = got != want
    else:
        n = len(stack)
        scale = np.abs(stack).prod(axis=0) if op is ReduceOp.PROD else np.abs(stack).sum(axis=0)
        scale = scale / n if op is ReduceOp.AVG else scale
        bad = ~(np.abs(got - want) <= n * EPS[dtype] * scale)
    if not bad.any():
        return []
    i = int(np.flatnonzero(bad)[0])
    return [
        f"{what}: {int(bad.sum())} of {bad.size} differ, first at {i}: got "
        f"{got.reshape(-1)[i]}, want {want.reshape(-1)[i]}"
    ]
