"""`hetcomm bench --latency --check-cost`: every host op form with the default check beside
the same op on a Communicator without it, in the same interleaved rounds."""

import pytest
from mpi4py import MPI

from hetcomm.bench import main as bench
from hetcomm.bench.latency_table import FORMS, parse_table


@pytest.mark.mpi(min_size=2)
def test_check_cost_section_pairs_every_host_form(capsys):
    args = ["--latency", "--check-cost", "-b", "8", "-e", "8", "-n", "2", "--rounds", "2"]
    code = bench.main([*args, "-w", "1", "--transport", "mpi", "--no-progress"])
    assert code == 0
    printed = capsys.readouterr().out
    if MPI.COMM_WORLD.Get_rank() != 0:
        return
    rows = parse_table(printed)
    check = [r for r in rows if r["section"] == "check"]
    host = [r for r in rows if r["section"] == "host"]
    assert [(r["op"], r["form"]) for r in check] == [(r["op"], r["form"]) for r in host]
    assert [(r["op"], r["form"]) for r in check] == list(FORMS)
    for r in check:
        assert r["floor"] == "unchecked" and float(r["floor(us)"]) > 0, r
        assert float(r["hetcomm(us)"]) > 0 and float(r["ratio"]) > 0, r


def test_check_cost_refuses_the_unchecked_run():
    with pytest.raises(SystemExit, match="check-cost"):
        bench.main(["--latency", "--check-cost", "--no-mismatch-check", "-b", "8", "-e", "8"])
