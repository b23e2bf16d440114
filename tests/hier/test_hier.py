"""The hier transport on the CPU: simulated islands (vendors and hosts per rank), every
operation forced onto hier with host arrays, checked against numpy float64 references.

Each job runs every collective x dtype (bfloat16 through torch CPU tensors) x reduce op x count
(empty, fewer elements than ranks, counts no island divides, a large one), synchronously and
asynchronously; the ranks check their own results and report; this side checks that every
rank's all_reduce results are bitwise identical and that the plan and the parts are as designed.
"""

from __future__ import annotations

import re

import pytest

# float16 everywhere and bfloat16 in most jobs (hetcomm's own kernels reduce them); the other
# dtypes spread over the layouts, and test_mpi_suite_on_hier runs every dtype on 3 + 1
DTYPES = ["float64", "float32", "float16", "bfloat16", "int32", "uint8", "bool"]
FEW_DTYPES = ["float32", "float16", "bfloat16", "int64"]
NO_TORCH = ["float32", "float16", "int8"]  # jobs without bfloat16 need not load torch
# (ranks, vendor, host) in rank order -> islands; the dtypes and counts each job runs. 70_001
# float32 elements take the MPI transport's large-message path inside the islands.
LAYOUTS = {
    "2+2": ([(2, "nvidia", "ha"), (2, "amd", "ha")], DTYPES, [0, 1, 3, 7, 1001], 70_001),
    "3+1": ([(3, "nvidia", "ha"), (1, "amd", "ha")], NO_TORCH, [0, 1, 2, 7, 1001], 70_001),
    "1+1": ([(1, "nvidia", "ha"), (1, "amd", "ha")], NO_TORCH, [0, 1, 7, 1001], 70_001),
    "1+2+1": (
        [(1, "nvidia", "ha"), (2, "amd", "ha"), (1, "cpu", "hb")],
        FEW_DTYPES,
        [1, 3, 7, 1001],
        0,
    ),
    "interleaved 2+2": (
        [(1, "nvidia", "ha"), (1, "amd", "ha"), (1, "nvidia", "ha"), (1, "amd", "ha")],
        NO_TORCH,
        [3, 1001],
        0,
    ),
}
REASON = "{} vendor islands: native inside, staged/direct between"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_collectives_on_islands(hier_job, layout: str) -> None:
    ranks, dtypes, counts, large = LAYOUTS[layout]
    n = sum(count for count, _, _ in ranks)
    params = {"dtypes": dtypes, "counts": counts, "large": large}
    job = hier_job(ranks, "collectives", params, limit=150)
    results = job.ranks(n)
    seed = results[0]["seed"]
    for r in results:
        assert r["ok"], f"rank {r['rank']} (seed {seed}): {r['n_errors']} errors: {r['errors']}"
    # every rank's all_reduce outputs, bit for bit the same
    digests = {r["digest"] for r in results}
    assert len(digests) == 1, f"all_reduce results differ in their bits across ranks: {digests}"
    for r in results:
        assert r["plan"] == ["hier", "forced by HETCOMM_TRANSPORT"]
        assert r["device_plan"] == ["hier", "forced by HETCOMM_TRANSPORT"]
        assert "hier" in r["routed"], r["routed"]
        # without forcing: host buffers on mpi; device collectives across islands on hier,
        # with the reason; point-to-point not on hier
        islands = 3 if layout == "1+2+1" else 2
        assert r["auto"]["all_reduce device"] == ["hier", REASON.format(islands)], r["auto"]
        assert r["auto"]["all_gather device"][0] == "hier", r["auto"]
        assert r["auto"]["send device"][0] not in ("hier", "none"), r["auto"]
        assert r["auto"]["all_reduce host"][0] == "mpi", r["auto"]
        # the parts plan for themselves and never choose hier again
        assert len(r["parts"]) == 3, r["parts"]
        for name, part in r["parts"].items():
            assert part["hier"] == "inside a hier transport", (name, part)
            assert part["host"] == "mpi" and part["device"] not in ("hier", "none"), (name, part)


def test_timeouts_abort_and_close(hier_job) -> None:
    """Rank 0 alone calls: the first collective (whose default check, made before the hier
    transport's setup, catches the missing rank), an operation with a per-op timeout, and an
    async operation under the configured timeout each raise CommTimeout naming the group; the
    communicator then refuses calls with CommAborted and closes promptly."""
    ranks = [(1, "nvidia", "ha"), (1, "amd", "ha")]
    job = hier_job(ranks, "timeouts", {}, limit=60)
    lone = job.ranks(2)[0]
    for case, group, op in (
        ("setup", "lonely-setup", "all_reduce"),
        ("op", "lonely-op", "all_reduce"),
        ("async", "lonely-async", "all_reduce"),
    ):
        found = lone[case]
        assert found["error"] == "CommTimeout", (case, found, job.explain())
        assert (found["group"], found["op"]) == (group, op), (case, found)
        assert found["seconds"] < 10, (case, found)
        assert found["then"] == "CommAborted", (case, found)
    assert lone["close_s"] < 10, lone


def test_mpi_suite_on_hier(hier_pytest) -> None:
    """The collectives and point-to-point tests of tests/mpi (every dtype, numpy and torch, empty,
    0-d, strided and transposed arrays, sentinels around every output), on islands 3 + 1 with
    hier forced: every rank's pytest passes."""
    job = hier_pytest(
        [(3, "nvidia", "ha"), (1, "amd", "ha")], ["test_collectives.py", "test_p2p.py"]
    )
    text = re.sub(r"\x1b\[[0-9;]*m", "", job.stdout)  # pytest's colours
    summaries = [
        line for line in text.splitlines() if "passed" in line and re.search(r" in [\d.]+s", line)
    ]
    assert job.returncode == 0 and len(summaries) == 4, job.explain()
    for line in summaries:
        assert "failed" not in line and "error" not in line, job.explain()
