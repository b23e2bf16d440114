"""`hetcomm tune --quick` in-process under mpirun: the cache file, and communicators using it."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mpi4py import MPI

import hetcomm
from hetcomm import cli, introspect, tune, tuning
from hetcomm.testing import assert_all_ranks
from hetcomm.transports.staged.transport import CHUNK_BYTES, SLOTS


def _staged(comm: Any) -> Any:
    return introspect.transport_of(comm, "send", np.zeros(1, np.uint8))


@pytest.mark.mpi(min_size=2)
def test_tune_quick_writes_the_cache_that_communicators_and_info_use(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    # one directory for every rank: rank 0 makes it and tells the others
    where = world.bcast(tempfile.mkdtemp(prefix="hetcomm-tune-") if rank == 0 else None, root=0)
    monkeypatch.setenv("HETCOMM_TUNE_DIR", where)
    monkeypatch.delenv("HETCOMM_DIRECT_MIN", raising=False)
    try:
        assert cli.main(["tune", "--quick"]) == 0
        capsys.readouterr()
        # every rank sees the one directory: this fails alike everywhere
        files = sorted(Path(where).iterdir())
        assert len(files) == 1 and files[0].suffix == ".json", files
        data = json.loads(files[0].read_text())

        c = hetcomm.init(config=hetcomm.Config.load(transport="staged"))
        fp = c.topology.fingerprint()
        t = _staged(c)
        found: list[str] = []

        def expect(ok: bool, what: str) -> None:
            if not ok:
                found.append(what)

        expect(files[0].name == f"{fp}.json", f"file {files[0].name}, fingerprint {fp}")
        expect(
            data.get("schema") == tuning.SCHEMA and data.get("ranks") == world.Get_size(),
            f"schema/ranks of {data}",
        )
        expect(data["chunk_bytes"]["value"] in tune.QUICK.chunks, f"chunk {data['chunk_bytes']}")
        expect(
            set(data["chunk_bytes"]["median_s"]) == {str(k) for k in tune.QUICK.chunks},
            f"chunk medians {data['chunk_bytes']}",
        )
        expect(data["slots"]["value"] in (*tune.QUICK.slots, SLOTS), f"slots {data['slots']}")
        expect(
            bool(data["rails"])
            and all(0 < r["weight"] <= 1 and r["GBps"] > 0 for r in data["rails"].values()),
            f"{data['rails']}",
        )
        expect(
            data["direct_min"]["value"] is None
            and data["direct_min"]["note"].startswith("not measured: "),
            f"direct_min on the CPU {data['direct_min']}",
        )
        lanes = data.get("lane_min", {})
        expect(
            set(lanes.get("value", {})) == set(tuning.LANE_OPS)
            and lanes.get("sizes") == list(tune.QUICK.lane_sizes),
            f"lane_min {lanes}",
        )
        # the tuned values are in effect: the quick chunks all differ from the built-in one
        expect(c.config.tuned is not None and c.config.tuned.path == str(files[0]), "not tuned")
        expect(
            t.chunk_bytes == data["chunk_bytes"]["value"] != CHUNK_BYTES,
            f"transport chunk {t.chunk_bytes}",
        )
        expect(t.slots == data["slots"]["value"], f"transport slots {t.slots}")
        on_mpi = hetcomm.init(config=hetcomm.Config.load(transport="mpi"))
        lane = introspect.transport_of(on_mpi, "all_reduce", np.zeros(1)).lane_min
        expect(
            all(lane[op] == v for op, v in lanes.get("value", {}).items()),
            f"the mpi transport's lane_min {lane}, the file's {lanes}",
        )
        on_mpi.close()
        # a message of several tuned chunks still arrives whole
        n = 3 * t.chunk_bytes + 5
        x = np.arange(n, dtype=np.int64).astype(np.uint8)
        y = np.zeros(n, np.uint8)
        peer = rank ^ 1
        if peer < c.size:
            if rank % 2 == 0:
                c.send(x, peer)
            else:
                c.recv(y, peer)
                expect(bool((y == x).all()), "message in tuned chunks arrived wrong")
        c.close()

        # precedence: HETCOMM_DIRECT_MIN > the tuned value > the default
        if rank == 0:
            tune.write(files[0], {**data, "direct_min": {"value": 12345}})
        world.Barrier()
        c = hetcomm.init()
        expect(c.config.direct_min == 12345, f"tuned direct_min {c.config.direct_min}")
        c.close()
        monkeypatch.setenv("HETCOMM_DIRECT_MIN", "7")
        c = hetcomm.init()
        expect(c.config.direct_min == 7, f"explicit direct_min {c.config.direct_min}")
        c.close()
        monkeypatch.delenv("HETCOMM_DIRECT_MIN")

        capsys.readouterr()
        assert cli.main(["info"]) == 0
        out = capsys.readouterr().out
        if rank == 0:
            expect(
                f"in use for topology {fp}" in out
                and str(files[0]) in out
                and f"chunk bytes:  {data['chunk_bytes']['value']}" in out
                and "direct_min in effect: 12345 (tuned" in out,
                f"info said:\n{out}",
            )

        # a corrupt file: ignored (defaults), never an exception
        if rank == 0:
            files[0].write_text("{corrupt")
        world.Barrier()
        c = hetcomm.init(config=hetcomm.Config.load(transport="staged"))
        expect(
            c.config.tuned is None and _staged(c).chunk_bytes == CHUNK_BYTES,
            "a corrupt file was used",
        )
        c.close()
        assert cli.main(["info"]) == 0
        out = capsys.readouterr().out
        if rank == 0:
            expect(f"none for topology {fp}" in out, f"info said:\n{out}")
        verdict = hetcomm.init()
        try:
            assert_all_ranks(verdict, not found, "; ".join(found))
        finally:
            verdict.close()
    finally:
        world.Barrier()
        if rank == 0:
            shutil.rmtree(where, ignore_errors=True)
