"""The numpy demo's hand-written gradients (scripts/pp_train_numpy.py) against finite
differences."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "pp_train_numpy.py"


def _demo():
    spec = importlib.util.spec_from_file_location("pp_train_numpy", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gradients_match_finite_differences() -> None:
    demo = _demo()
    rng = np.random.default_rng()
    params, x, y = demo.make_params_and_data(1)
    params = [p + 0.1 * rng.standard_normal(p.shape) for p in params]  # fresh point
    rows = 8
    xs, ys = x[0, :rows], y[0, :rows]

    def loss(ps: list[np.ndarray]) -> float:
        h = demo.stage0_forward(ps[:2], xs)
        return demo.stage1_loss_and_grads(ps[2:], h, ys, rows)[0]

    h = demo.stage0_forward(params[:2], xs)
    _, g1, grad_h = demo.stage1_loss_and_grads(params[2:], h, ys, rows)
    grads = [*demo.stage0_grads(params[:2], xs, grad_h), *g1]
    eps = 1e-6
    for k, (p, g) in enumerate(zip(params, grads)):
        assert g.shape == p.shape
        for idx in [tuple(rng.integers(0, n) for n in p.shape) for _ in range(5)]:
            up = [q.copy() for q in params]
            down = [q.copy() for q in params]
            up[k][idx] += eps
            down[k][idx] -= eps
            numeric = (loss(up) - loss(down)) / (2 * eps)
            assert abs(numeric - g[idx]) <= 1e-6 * max(1.0, abs(numeric)), (k, idx, numeric, g[idx])
