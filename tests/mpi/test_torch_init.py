"""torch.distributed backend "hetcomm" under mpirun: every way to initialise it (from MPI alone,
init_method="mpi://", an address, an explicit store, beside a gloo default group), ranks that
disagree with MPI, and the MPI store (every collective: test_torch_backend.py)."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from _torch_world import ADDRESS_VARS
from mpi4py import MPI

import hetcomm.torch as ht
from hetcomm.testing import loopback_port

pytestmark = pytest.mark.mpi(min_size=2)


@pytest.fixture
def no_address(monkeypatch: pytest.MonkeyPatch) -> None:
    """What mpirun alone provides: no MASTER_ADDR, MASTER_PORT, RANK or WORLD_SIZE."""
    for var in ADDRESS_VARS:
        monkeypatch.delenv(var, raising=False)


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for MASTER_PORT, chosen by rank 0 and known to every rank."""
    port = loopback_port() if MPI.COMM_WORLD.Get_rank() == 0 else None
    return int(MPI.COMM_WORLD.bcast(port, root=0))


def tcp_store(rank: int, size: int) -> dist.TCPStore:
    """A TCPStore on 127.0.0.1 whose server is rank 0 (port chosen by rank 0, then shared)."""
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, size, True, wait_for_workers=False)
        port = MPI.COMM_WORLD.bcast(store.port, root=0)
    else:
        port = MPI.COMM_WORLD.bcast(None, root=0)
        store = dist.TCPStore("127.0.0.1", port, size, False)
    MPI.COMM_WORLD.Barrier()  # every client is connected before rank 0 may drop the server
    return store


# ---- initialisation ----------------------------------------------------------------------------


class TestInit:
    def check_world(self, errors, how: str) -> None:
        rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
        errors.expect(
            (dist.get_rank(), dist.get_world_size()) == (rank, size),
            f"{how}: torch says rank {dist.get_rank()} of {dist.get_world_size()}",
        )
        errors.expect(dist.get_backend() == "hetcomm", f"{how}: backend {dist.get_backend()}")
        errors.expect(isinstance(dist.group.WORLD, ht.ProcessGroupHetcomm), f"{how}: group type")
        t = torch.full((3,), float(rank + 1))
        dist.all_reduce(t)
        errors.expect(t.tolist() == [size * (size + 1) / 2] * 3, f"{how}: all_reduce gave {t}")

    def test_init_from_mpi_alone(self, errors, no_address) -> None:
        """No address, port, rank or size: all from MPI; twice in one job, each with a gloo
        group whose rendezvous runs over hetcomm's MPI store (fresh keys each time)."""
        for attempt in range(2):
            dist.init_process_group("hetcomm")
            try:
                self.check_world(errors, f"init #{attempt}")
                gloo = dist.new_group(backend="gloo")
                t = torch.ones(2)
                dist.all_reduce(t, group=gloo)
                errors.expect(t.tolist() == [dist.get_world_size()] * 2, f"gloo #{attempt}: {t}")
            finally:
                dist.destroy_process_group()
        errors.verify()

    def test_init_method_mpi(self, errors) -> None:
        dist.init_process_group("hetcomm", init_method="mpi://", timeout=timedelta(seconds=120))
        try:
            self.check_world(errors, "mpi://")
            group = dist.group.WORLD
            errors.expect(group.timeout_s == 120, f"the group's timeout is {group.timeout_s}")
            self.check_timeout_is_the_communicators(errors, group, 120)
            sub = dist.new_group(timeout=timedelta(seconds=77))
            self.check_timeout_is_the_communicators(errors, sub, 77)
        finally:
            dist.destroy_process_group()
        errors.verify()

    @staticmethod
    def check_timeout_is_the_communicators(errors, group, seconds: float) -> None:
        """A group's timeout (torch's, set by the user) is its Communicator's own, so blocking
        calls need no timeout of their own and take their prepared routes (counted, where the
        transport prepares the route: on one host's ranks, not over staged's tcp or mpi
        rails), with the right result."""
        comm = group.comm
        errors.expect(comm.config.timeout == seconds, f"the communicator's {comm.config.timeout}")
        before = {r["key"]: r["runs"] for r in comm.routes()}
        t = torch.ones(3)
        for _ in range(3):
            dist.all_reduce(t, group=group)
        n = dist.get_world_size(group)
        errors.expect(t.tolist() == [float(n**3)] * 3, f"all_reduce gave {t.tolist()}")
        runs = {r["key"]: r["runs"] - before.get(r["key"], 0) for r in comm.routes()}
        reduces = [r for r in comm.routes() if r["op"] == "all_reduce"]
        errors.expect(bool(reduces), "no all_reduce route")
        for r in reduces:
            if r["prepared"]:
                errors.expect(runs[r["key"]] >= 3, f"the prepared all_reduce ran {runs[r['key']]}x")

    def test_init_env_with_address(self, errors, monkeypatch) -> None:
        rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
        for var, value in zip(ADDRESS_VARS, ("127.0.0.1", free_port(), rank, size)):
            monkeypatch.setenv(var, str(value))
        dist.init_process_group("hetcomm", init_method="env://")
        try:
            self.check_world(errors, "env://")
            errors.expect(
                isinstance(dist.distributed_c10d._get_default_store(), dist.Store),
                "env:// makes torch's own store",
            )
        finally:
            dist.destroy_process_group()
        errors.verify()

    def test_init_with_explicit_store(self, errors) -> None:
        rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
        dist.init_process_group("hetcomm", store=tcp_store(rank, size), rank=rank, world_size=size)
        try:
            self.check_world(errors, "store=")
        finally:
            dist.destroy_process_group()
        errors.verify()

    def test_hetcomm_groups_beside_a_gloo_default(self, errors, no_address) -> None:
        """gloo as the default group (its env:// rendezvous falls back to MPI under mpirun),
        hetcomm groups made with new_group(backend="hetcomm")."""
        n, me = MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()
        dist.init_process_group("gloo")
        try:
            errors.expect(dist.get_backend() == "gloo", f"default backend {dist.get_backend()}")
            everyone = dist.new_group(backend="hetcomm")
            firsts = dist.new_group([0, 1], backend="hetcomm")
            t = torch.full((2,), float(me))
            dist.all_reduce(t, group=everyone)
            errors.expect(
                isinstance(everyone, ht.ProcessGroupHetcomm)
                and t.tolist() == [n * (n - 1) / 2] * 2,
                f"hetcomm group: {t}",
            )
            if me < 2:
                t = torch.ones(1)
                dist.all_reduce(t, group=firsts)
                errors.expect(t.item() == 2.0, f"hetcomm group of two: {t}")
            dist.all_reduce(t := torch.ones(1))
            errors.expect(t.item() == n, "the gloo default group still works")
        finally:
            dist.destroy_process_group()
        errors.verify()

    def test_ranks_that_disagree_with_mpi_are_refused(self, errors) -> None:
        rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
        other = (rank + 1) % size
        store = tcp_store(rank, size)
        with pytest.raises(ValueError, match=f"MPI makes this process rank {rank} of {size}"):
            dist.init_process_group("hetcomm", store=store, rank=other, world_size=size)
        errors.expect(not dist.is_initialized(), "a refused init leaves no default group")
        with pytest.raises(ValueError, match=f"rank={other} was given, but MPI says {rank}"):
            dist.init_process_group("hetcomm", init_method="mpi://", rank=other, world_size=size)
        errors.expect(not dist.is_initialized(), "a refused init leaves no default group")
        errors.verify()

    def test_mpi_store(self, errors) -> None:
        """Every Store operation, from every rank, against rank 0's server."""
        rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
        store = ht.MpiStore(timeout=timedelta(seconds=30))
        store.set(f"k{rank}", f"v{rank}")
        errors.expect(store.add("counter", rank + 1) >= rank + 1, "add returns the new value")
        store.wait([f"k{r}" for r in range(size)])
        errors.expect(
            store.get(f"k{(rank + 1) % size}") == f"v{(rank + 1) % size}".encode(),
            "get another rank's key",
        )
        errors.expect(store.check([f"k{r}" for r in range(size)]), "check sees every key")
        errors.expect(not store.check(["nobody-set-this"]), "check of a missing key")
        store.append("log", f"{rank};")
        MPI.COMM_WORLD.Barrier()
        errors.expect(int(store.get("counter")) == size * (size + 1) // 2, "every add counted")
        got = sorted(store.get("log").decode().strip(";").split(";"))
        errors.expect(got == sorted(str(r) for r in range(size)), f"append: {got}")
        errors.expect(
            store.multi_get([f"k{r}" for r in range(size)])
            == [f"v{r}".encode() for r in range(size)],
            "multi_get",
        )
        if rank == 0:
            errors.expect(store.compare_set("cas", "", "first") == b"first", "cas on no key")
            errors.expect(store.compare_set("cas", "wrong", "x") == b"first", "cas mismatch")
            errors.expect(store.compare_set("cas", "first", "second") == b"second", "cas match")
            store.multi_set(["m1", "m2"], ["a", b"b"])
        MPI.COMM_WORLD.Barrier()
        errors.expect(store.get("m2") == b"b" and store.get("cas") == b"second", "multi_set")
        errors.expect(store.num_keys() >= size + 5, f"num_keys {store.num_keys()}")
        MPI.COMM_WORLD.Barrier()
        if rank == size - 1:
            errors.expect(store.delete_key("m1") and not store.delete_key("m1"), "delete_key")
        store.set_timeout(timedelta(seconds=0.3))
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"timed out waiting for keys \['never'\]"):
            store.get("never")
        errors.expect(time.monotonic() - t0 < 10, "a get of a missing key ends at the timeout")
        errors.verify()
