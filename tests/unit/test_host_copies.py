"""Unit tests for hetcomm.kernels.host_copies: small host<->device copies queued as 2D rows.

The shapes are checked for every size they apply to, and the calls they make are replayed on
host memory by a runtime whose copies are ctypes.memmove (row by row at the given pitches), so
the bytes moved are compared against numpy without a GPU. tests/gpu/test_host_copies_gpu.py
makes the same copies on a GPU.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest
from hetcomm.kernels.host_copies import MAX_WIDTH, SMALL_BYTES, memcpy_async, rows

H2D, D2H, D2D, DEFAULT = 1, 2, 3, 4


class HostRuntime:
    """cudaMemcpyAsync and cudaMemcpy2DAsync over host addresses, recording each call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []  # (name, kind, stream)

    def memcpyAsync(self, dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
        self.calls.append(("1d", kind, stream))
        ctypes.memmove(dst, src, nbytes)

    def memcpy2DAsync(
        self,
        dst: int,
        dpitch: int,
        src: int,
        spitch: int,
        width: int,
        height: int,
        kind: int,
        stream: int,
    ) -> None:
        assert width <= dpitch and width <= spitch
        self.calls.append(("2d", kind, stream))
        for row in range(height):
            ctypes.memmove(dst + row * dpitch, src + row * spitch, width)


def test_rows_cover_every_small_size_exactly() -> None:
    for nbytes in range(SMALL_BYTES + 2):
        shape = rows(nbytes)
        if nbytes < 2 or nbytes >= SMALL_BYTES:
            assert shape == (), nbytes
            continue
        assert 1 <= len(shape) <= 2, (nbytes, shape)
        offset = 0
        for start, width, height in shape:
            assert start == offset, (nbytes, shape)
            assert height >= 2 and 1 <= width <= MAX_WIDTH, (nbytes, shape)
            assert width & (width - 1) == 0, (nbytes, shape)
            offset += width * height
        assert offset == nbytes, (nbytes, shape)
        # no copy is a long run of narrow rows
        assert all(w >= 64 or h < 192 for _, w, h in shape), (nbytes, shape)


@pytest.mark.parametrize(
    ("nbytes", "expected"),
    [
        (2, ((0, 1, 2),)),
        (8, ((0, 4, 2),)),
        (1024, ((0, 512, 2),)),
        (24576, ((0, 4096, 6),)),
        (20011, ((0, 64, 311), (19904, 1, 107))),
        (191, ((0, 1, 191),)),
        (192, ((0, 64, 3),)),
    ],
)
def test_rows_shapes(nbytes: int, expected: tuple[tuple[int, int, int], ...]) -> None:
    assert rows(nbytes) == expected


@pytest.fixture
def rng() -> tuple[np.random.Generator, str]:
    seed = int(os.environ.get("HETCOMM_TEST_SEED") or np.random.SeedSequence().entropy)
    return np.random.default_rng(seed), f"(seed {seed}; rerun with HETCOMM_TEST_SEED={seed})"


@pytest.mark.parametrize("kind", [H2D, D2H, DEFAULT, D2D])
def test_memcpy_async_moves_exactly_the_bytes(kind: int, rng) -> None:
    gen, seed = rng
    sizes = [0, 1, 2, 3, 8, 63, 64, 65, 1023, 4096, 20011, SMALL_BYTES - 1, SMALL_BYTES, 40001]
    sizes += [int(n) for n in gen.integers(2, SMALL_BYTES, 20)]
    guard = 17
    for nbytes in sizes:
        src = gen.integers(0, 256, nbytes + 2 * guard, dtype=np.uint8)
        dst = gen.integers(0, 256, nbytes + 2 * guard, dtype=np.uint8)
        before = dst.copy()
        rt = HostRuntime()
        memcpy_async(rt, dst.ctypes.data + guard, src.ctypes.data + guard, nbytes, kind, 7)
        expected = before.copy()
        expected[guard : guard + nbytes] = src[guard : guard + nbytes]
        np.testing.assert_array_equal(dst, expected, err_msg=f"{nbytes} B, kind {kind} {seed}")
        names = [name for name, _, _ in rt.calls]
        assert all(k == kind and s == 7 for _, k, s in rt.calls)
        if kind == D2D or nbytes < 2 or nbytes >= SMALL_BYTES:
            assert names == ["1d"], (nbytes, kind, names)
        else:
            assert names == ["2d"] * len(rows(nbytes)), (nbytes, kind, names)


def test_a_runtime_without_2d_copies_copies_in_one() -> None:
    class Plain:
        def __init__(self) -> None:
            self.calls: list[int] = []

        def memcpyAsync(self, dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
            self.calls.append(nbytes)
            ctypes.memmove(dst, src, nbytes)

    src = np.arange(100, dtype=np.uint8)
    dst = np.zeros(100, np.uint8)
    rt = Plain()
    memcpy_async(rt, dst.ctypes.data, src.ctypes.data, 100, H2D, 0)
    assert rt.calls == [100]
    np.testing.assert_array_equal(dst, src)
