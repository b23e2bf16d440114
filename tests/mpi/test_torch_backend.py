"""torch.distributed backend "hetcomm" under mpirun: every collective (its init forms:
test_torch_init.py; training with DDP and FSDP2: test_torch_training.py).

Modelled on torch's checks for third-party backends (PythonProcessGroupExtensionTest in
test_c10d_common.py, the argument checks of test_c10d_gloo.py) and on the training parity a user
expects: DDP and FSDP2 on "hetcomm" reach gloo's parameters, and both reach a float64 reference
computed on one rank. Inputs come from the shared seed, so every rank draws every rank's data and
computes the expected result by itself with numpy. Findings are collected in `errors` and checked
together (`errors.verify()`), so that a mismatch on one rank cannot leave the others waiting.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _data import compare, draw, logical, reference, to_array

import hetcomm.torch as ht
from hetcomm import ReduceOp
from hetcomm.torch.work import _Pending

pytestmark = pytest.mark.mpi(min_size=2)

OPS = {
    "SUM": ReduceOp.SUM,
    "AVG": ReduceOp.AVG,
    "PRODUCT": ReduceOp.PROD,
    "MIN": ReduceOp.MIN,
    "MAX": ReduceOp.MAX,
}
DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64", "int8", "uint8", "bool")
all_gather_single = ht.dist_function("all_gather_single")
reduce_scatter_single = ht.dist_function("reduce_scatter_single")


def ops_for(dtype: str) -> list[str]:
    """Every op for floats; no AVG for integers (truncation is hetcomm's, not torch's) or bool."""
    return [name for name in OPS if dtype.startswith(("float", "bfloat")) or name != "AVG"]


def torch_tensor(values: np.ndarray, dtype: str) -> torch.Tensor:
    return to_array(values, dtype, "torch")


# ---- every collective ---------------------------------------------------------------------------


@pytest.mark.usefixtures("pg")
class TestCollectives:
    @pytest.mark.parametrize("dtype", DTYPES)
    def test_all_reduce(self, rng, errors, dtype: str) -> None:
        n, me = dist.get_world_size(), dist.get_rank()
        for name in ops_for(dtype):
            for shape in ((0,), (1,), (5, 3)):
                stack = draw(rng, dtype, shape, n)
                t = torch_tensor(stack[me], dtype)
                dist.all_reduce(t, op=getattr(dist.ReduceOp, name))
                errors += compare(
                    logical(t),
                    reference(stack, OPS[name], dtype),
                    f"{name} {list(shape)}",
                    stack=stack,
                    op=OPS[name],
                    dtype=dtype,
                )
        # non-contiguous, asynchronous
        stack = draw(rng, dtype, (4, 6), n)
        base = torch_tensor(stack[me].T.copy(), dtype)
        work = dist.all_reduce(base.t(), op=dist.ReduceOp.MAX, async_op=True)
        work.wait()
        errors += compare(logical(base.t()), reference(stack, ReduceOp.MAX, dtype), "transposed")
        errors.verify()

    def test_float16_sums_many_elements(self, rng, errors) -> None:
        n, me = dist.get_world_size(), dist.get_rank()
        stack = draw(rng, "float16", (4099,), n)
        t = torch_tensor(stack[me], "float16")
        dist.all_reduce(t)
        errors += compare(
            logical(t),
            stack.sum(axis=0),
            "float16 SUM",
            stack=stack,
            op=ReduceOp.SUM,
            dtype="float16",
        )
        errors.verify()

    def test_work_and_future(self, rng, errors) -> None:
        """DDP's contract: the future completes without anyone calling wait(), carries the
        result tensors, and chains with then()."""
        n, me = dist.get_world_size(), dist.get_rank()
        stack = draw(rng, "float64", (1000,), n)
        t = torch_tensor(stack[me], "float64")
        work = dist.all_reduce(t, async_op=True)
        fut = work.get_future()
        deadline = time.monotonic() + 30
        while not fut.done() and time.monotonic() < deadline:
            time.sleep(0.001)
        errors.expect(fut.done(), "the future completed without a wait()")
        errors.expect(work.is_completed() and work.is_success(), "work says done")
        value = fut.wait()
        errors.expect(isinstance(value, list) and value[0] is t, "the future carries the tensor")
        errors += compare(
            logical(t),
            stack.sum(axis=0),
            "async SUM",
            stack=stack,
            op=ReduceOp.SUM,
            dtype="float64",
        )
        errors.expect(work.wait() is True, "wait() returns True")
        doubled = (
            dist.all_reduce(t.clone(), async_op=True)
            .get_future()
            .then(lambda f: f.value()[0] * 2)
            .wait()
        )
        errors += compare(
            logical(doubled),
            2 * n * logical(t),
            "then()",
            stack=stack * 2 * n,
            op=ReduceOp.SUM,
            dtype="float64",
        )
        errors.verify()

    def test_future_completed_by_the_thread_that_ends_the_operation(self, rng, errors, pg):
        """DDP's futures without a wait: a large asynchronous all_reduce, whether a transport's
        own thread ends it (the mpi lane's job, a staged driver's body, the hier worker's
        job: its Work has a signal) or the progress thread polls it (MPI requests), completes
        its future, whose callbacks never run on a transport's thread (user code there could
        wait for that thread). Data against a float64 sum every round
        (tests/unit/test_torch_progress.py pins who completes what)."""
        n, me = dist.get_world_size(), dist.get_rank()
        for round in range(6):
            stack = draw(rng, "float64", (1 << 17 << round % 2,), n)  # 1 and 2 MiB
            t = torch_tensor(stack[me], "float64")
            work = dist.all_reduce(t, async_op=True)
            pending = work._pending
            signalled = isinstance(pending, _Pending) and pending.signals() is not None
            where: list[str] = []
            fut = work.get_future()
            # the callback runs just after the future is marked done: wait for the chained one
            chained = fut.then(lambda f, where=where: where.append(threading.current_thread().name))
            deadline = time.monotonic() + 30
            while not chained.done() and time.monotonic() < deadline:
                time.sleep(0.001)
            errors.expect(fut.done(), f"round {round}: the future completed without a wait()")
            errors.expect(
                where in (["hetcomm-torch-progress"], ["MainThread"]),
                f"round {round} (signalled: {signalled}): a callback ran on {where}",
            )
            errors += compare(
                logical(t),
                stack.sum(axis=0),
                f"round {round}",
                stack=stack,
                op=ReduceOp.SUM,
                dtype="float64",
            )
        errors.verify()

    def test_allreduce_coalesced(self, rng, errors, pg) -> None:
        n, me = dist.get_world_size(), dist.get_rank()
        for dtypes in (("float32", "float32", "float32"), ("float32", "int64", "float64")):
            stacks = [draw(rng, d, (i + 2, 3), n) for i, d in enumerate(dtypes)]
            ts = [torch_tensor(s[me], d) for s, d in zip(stacks, dtypes)]
            opts = dist.AllreduceCoalescedOptions()
            opts.reduceOp = dist.ReduceOp.SUM
            pg.allreduce_coalesced(ts, opts).wait()
            for t, s, d in zip(ts, stacks, dtypes):
                errors += compare(
                    logical(t),
                    reference(s, ReduceOp.SUM, d),
                    f"coalesced {d}",
                    stack=s,
                    op=ReduceOp.SUM,
                    dtype=d,
                )
        errors.verify()

    @pytest.mark.filterwarnings("ignore:`torch.distributed.all_reduce_coalesced`:FutureWarning")
    def test_allreduce_coalesced_fused(self, rng, errors, pg) -> None:
        """One hetcomm all_reduce_coalesced per call: every op over mixed dtypes, strided views,
        empty and 0-d tensors; dist.all_reduce_coalesced async and on complex tensors; tensors
        that overlap are refused before anything moves."""
        n, me = dist.get_world_size(), dist.get_rank()
        shapes = ((5,), (4, 6), (0,), ())
        for name, op in OPS.items():
            dtypes = [
                d
                for d in ("float32", "bfloat16", "int64", "float64", "bool", "uint8")
                if name in ops_for(d) and not (d == "bool" and name == "AVG")
            ]
            stacks, ts = [], []
            for k, d in enumerate(dtypes):
                shape = shapes[k % len(shapes)]
                stack = draw(rng, d, shape, n)
                t = torch_tensor(stack[me], d)
                if len(shape) == 2:  # a transposed view of a (6, 4) tensor
                    t = torch_tensor(stack[me].T.copy(), d).t()
                stacks.append(stack)
                ts.append(t)
            opts = dist.AllreduceCoalescedOptions()
            opts.reduceOp = getattr(dist.ReduceOp, name)
            pg.allreduce_coalesced(ts, opts).wait()
            for t, s, d in zip(ts, stacks, dtypes):
                errors += compare(
                    logical(t),
                    reference(s, op, d),
                    f"coalesced {name} {d}",
                    stack=s,
                    op=op,
                    dtype=d,
                )
        stacks = [draw(rng, "float32", (k + 1, 3), n) for k in range(4)]
        ts = [torch_tensor(s[me].T.copy(), "float32").t() for s in stacks]
        dist.all_reduce_coalesced(ts, op=dist.ReduceOp.MAX, async_op=True).wait()
        for k, (t, s) in enumerate(zip(ts, stacks)):
            errors += compare(logical(t), s.max(axis=0), f"dist.all_reduce_coalesced MAX {k}")
        re, im = draw(rng, "float64", (2, 3), n), draw(rng, "float64", (2, 3), n)
        zs = [
            torch.complex(torch_tensor(re[me][i], "float64"), torch_tensor(im[me][i], "float64"))
            for i in range(2)
        ]
        dist.all_reduce_coalesced(zs)
        for i, z in enumerate(zs):
            errors += compare(
                z.real.numpy(),
                re[:, i].sum(axis=0),
                f"complex {i} (real)",
                stack=re[:, i],
                op=ReduceOp.SUM,
                dtype="float64",
            )
            errors += compare(
                z.imag.numpy(),
                im[:, i].sum(axis=0),
                f"complex {i} (imaginary)",
                stack=im[:, i],
                op=ReduceOp.SUM,
                dtype="float64",
            )
        base = torch.arange(10, dtype=torch.float32)
        try:
            pg.allreduce_coalesced([base[:6], base[4:]], dist.AllreduceCoalescedOptions()).wait()
            errors.append("overlapping tensors were accepted")
        except ValueError as exc:
            errors.expect("overlap" in str(exc), f"overlap: message {exc}")
        errors.expect(base.tolist() == list(range(10)), f"overlap: tensor changed to {base}")
        errors.verify()

    def test_broadcast(self, rng, errors) -> None:
        n, me = dist.get_world_size(), dist.get_rank()
        for root in sorted({0, n - 1}):
            for dtype in ("float32", "int64", "bfloat16", "bool"):
                stack = draw(rng, dtype, (3, 4), n)
                t = torch_tensor(stack[me], dtype)
                dist.broadcast(t, src=root)
                errors += compare(logical(t), stack[root], f"broadcast {dtype} from {root}")
            # complex and non-contiguous
            z = torch.complex(torch.full((2, 3), float(me)), torch.full((2, 3), -float(me)))
            dist.broadcast(z.t(), src=root)
            errors.expect(bool((z == complex(root, -root)).all()), f"complex from {root}: {z}")
        objs = [{"rank": me}] if me == 0 else [None]
        dist.broadcast_object_list(objs, src=0)
        errors.expect(objs == [{"rank": 0}], f"broadcast_object_list gave {objs}")
        errors.verify()

    def test_reduce(self, rng, errors) -> None:
        n, me = dist.get_world_size(), dist.get_rank()
        for root in sorted({0, n - 1}):
            for name in ("SUM", "MAX", "PRODUCT"):
                stack = draw(rng, "float64", (6,), n)
                t = torch_tensor(stack[me], "float64")
                dist.reduce(t, dst=root, op=getattr(dist.ReduceOp, name))
                if me == root:
                    errors += compare(
                        logical(t),
                        reference(stack, OPS[name], "float64"),
                        f"reduce {name} to {root}",
                        stack=stack,
                        op=OPS[name],
                        dtype="float64",
                    )
                else:
                    errors += compare(logical(t), stack[me], f"reduce {name}: non-root changed")
        errors.verify()

    def test_all_gather(self, rng, errors) -> None:
        n, me = dist.get_world_size(), dist.get_rank()
        for dtype in ("float32", "int8", "bfloat16"):
            stack = draw(rng, dtype, (2, 3), n)
            t = torch_tensor(stack[me], dtype)
            outs = [torch.empty(3, 2, dtype=t.dtype).t() for _ in range(n)]  # non-contiguous
            dist.all_gather(outs, t)
            for r, o in enumerate(outs):
                errors += compare(logical(o), stack[r], f"all_gather {dtype} block {r}")
            flat = torch.empty(n * 6, dtype=t.dtype)
            all_gather_single(flat, t)
            errors += compare(logical(flat).reshape(n, 2, 3), stack, f"into tensor {dtype}")
        if hasattr(torch, "float8_e4m3fn"):  # no arithmetic: travels as bytes
            x = torch.full((4,), float(me)).to(torch.float8_e4m3fn)
            out = torch.empty(4 * n, dtype=torch.float8_e4m3fn)
            all_gather_single(out, x)
            want = torch.arange(n).repeat_interleave(4).float()
            errors.expect(torch.equal(out.float(), want), f"float8 all_gather: {out.float()}")
        got = [None] * n
        dist.all_gather_object(got, ("rank", me))
        errors.expect(got == [("rank", r) for r in range(n)], f"all_gather_object: {got}")
        errors.verify()

    def test_reduce_scatter(self, rng, errors) -> None:
        n, me = dist.get_world_size(), dist.get_rank()
        for name in ("SUM", "MIN", "AVG"):
            stack = draw(rng, "float32", (n, 5), n)  # rank r, block b
            want = reference(stack, OPS[name], "float32")[me]
            ins = [torch_tensor(stack[me][b], "float32") for b in range(n)]
            out = torch.empty(5)
            dist.reduce_scatter(out, ins, op=getattr(dist.ReduceOp, name))
            errors += compare(
                logical(out),
                want,
                f"reduce_scatter {name}",
                stack=stack[:, me],
                op=OPS[name],
                dtype="float32",
            )
            out2 = torch.empty(5)
            reduce_scatter_single(
                out2, torch_tensor(stack[me], "float32"), op=getattr(dist.ReduceOp, name)
            )
            errors += compare(
                logical(out2),
                want,
                f"reduce_scatter_tensor {name}",
                stack=stack[:, me],
                op=OPS[name],
                dtype="float32",
            )
        errors.verify()

    def test_all_to_all(self, errors) -> None:
        n, me = dist.get_world_size(), dist.get_rank()

        def rows(src: int, dst: int) -> int:
            return (src + 2 * dst) % 3  # some pairs exchange nothing

        def block(src: int, dst: int, k: int) -> torch.Tensor:
            return torch.full((k, 2), float(100 * src + dst))

        # equal blocks
        x = torch.cat([block(me, d, 2) for d in range(n)])
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x)
        want = torch.cat([block(s, me, 2) for s in range(n)])
        errors.expect(torch.equal(out, want), f"all_to_all_single equal: {out.flatten()}")
        # uneven splits, given as row counts
        x = torch.cat([block(me, d, rows(me, d)) for d in range(n)])
        out = torch.empty(sum(rows(s, me) for s in range(n)), 2)
        dist.all_to_all_single(
            out,
            x,
            output_split_sizes=[rows(s, me) for s in range(n)],
            input_split_sizes=[rows(me, d) for d in range(n)],
        )
        want = torch.cat([block(s, me, rows(s, me)) for s in range(n)])
        errors.expect(torch.equal(out, want), f"all_to_all_single uneven: {out.flatten()}")
        # lists of tensors of different sizes
        outs = [torch.empty(rows(s, me), 2) for s in range(n)]
        dist.all_to_all(outs, [block(me, d, rows(me, d)) for d in range(n)])
        for s, o in enumerate(outs):
            errors.expect(torch.equal(o, block(s, me, rows(s, me))), f"all_to_all from {s}: {o}")
        errors.verify()

    def test_gather_and_scatter(self, errors) -> None:
        n, me = dist.get_world_size(), dist.get_rank()
        for root in sorted({0, n - 1}):
            t = torch.full((3,), float(me))
            outs = [torch.empty(3) for _ in range(n)] if me == root else None
            dist.gather(t, gather_list=outs, dst=root)
            if me == root:
                assert outs is not None
                errors.expect(
                    all(torch.equal(o, torch.full((3,), float(r))) for r, o in enumerate(outs)),
                    f"gather to {root}: {outs}",
                )
            got = torch.empty(2, dtype=torch.int64)
            ins = [torch.full((2,), 10 * r, dtype=torch.int64) for r in range(n)]
            dist.scatter(got, scatter_list=ins if me == root else None, src=root)
            errors.expect(got.tolist() == [10 * me] * 2, f"scatter from {root}: {got}")
        errors.verify()

    def test_send_recv(self, errors) -> None:
        n, me = dist.get_world_size(), dist.get_rank()
        right, left = (me + 1) % n, (me - 1) % n
        mine, got = torch.full((5,), float(me)), torch.empty(5)
        if me % 2 == 0:
            dist.send(mine, dst=right, tag=3)
            dist.recv(got, src=left, tag=3)
        else:
            dist.recv(got, src=left, tag=3)
            dist.send(mine, dst=right, tag=3)
        errors.expect(got.tolist() == [float(left)] * 5, f"send/recv: {got}")
        got = torch.empty(5)
        works = [dist.irecv(got, src=left), dist.isend(mine * 2, dst=right)]
        for w in works:
            w.wait()
        errors.expect(got.tolist() == [2.0 * left] * 5, f"isend/irecv: {got}")
        got = torch.empty(5, dtype=torch.bfloat16)
        ops = [
            dist.P2POp(dist.irecv, got, left),
            dist.P2POp(dist.isend, (mine + 1).bfloat16(), right),
        ]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        errors.expect(got.tolist() == [left + 1.0] * 5, f"batch_isend_irecv: {got}")
        errors.verify()

    def test_barrier(self, errors) -> None:
        dist.barrier()
        work = dist.barrier(async_op=True)
        work.wait()
        errors.expect(work.is_completed(), "async barrier completed")
        errors.verify()

    def test_bad_arguments_raise_before_anything_moves(self, errors, pg) -> None:
        n = dist.get_world_size()
        t = torch.ones(4)
        with pytest.raises(ValueError, match="expected at least one tensor"):
            pg.allreduce([], dist.AllreduceOptions())
        # through the group itself: torch's own front end checks some of these first
        with pytest.raises(TypeError, match=r"expected dtype torch\.float32 like the input"):
            pg.allgather([[torch.empty(4)] * (n - 1) + [torch.empty(4, dtype=torch.int64)]], [t])
        with pytest.raises(ValueError, match="expected 4 elements like the input, got 5"):
            pg.allgather([[torch.empty(4)] * (n - 1) + [torch.empty(5)]], [t])
        with pytest.raises(ValueError, match=f"expected {n} tensors"):
            pg.allgather([[torch.empty(4)] * (n + 1)], [t])
        with pytest.raises(ValueError, match="expected one tensor"):
            pg.allreduce([t, t], dist.AllreduceOptions())
        with pytest.raises((TypeError, ValueError), match="dtype"):
            dist.all_gather([torch.empty(4)] * (n - 1) + [torch.empty(4, dtype=torch.int64)], t)
        with pytest.raises(ValueError, match=f"output must hold {n} x 4 elements"):
            all_gather_single(torch.empty(4 * n + 1), t)
        with pytest.raises(ValueError, match=f"input must hold {n} x 4 elements"):
            reduce_scatter_single(t, torch.empty(4 * n - 1))
        with pytest.raises(TypeError, match="expected dtype"):
            reduce_scatter_single(t, torch.empty(4 * n, dtype=torch.float64))
        with pytest.raises(ValueError, match="split sizes adding up to"):
            dist.all_to_all_single(torch.empty(n), torch.empty(n), [1] * n, [2] * n)
        opts = dist.BroadcastOptions()
        opts.rootRank = n
        with pytest.raises(ValueError, match=rf"expected a rank in \[0, {n}\)"):
            pg.broadcast([t], opts)
        for name in ("BAND", "BOR", "BXOR"):
            with pytest.raises(ValueError, match=f"ReduceOp.{name} is not supported"):
                dist.all_reduce(torch.ones(2, dtype=torch.int32), op=getattr(dist.ReduceOp, name))
        with pytest.raises(ValueError, match="PREMUL_SUM is not supported"):
            dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        with pytest.raises(ValueError, match="complex tensors reduce with SUM or AVG only"):
            pg.allreduce([torch.ones(2, dtype=torch.complex64)], opts)
        # gloo's backend refuses bad arguments with RuntimeError, torch's front end with
        # ValueError: hetcomm's refusals are both
        with pytest.raises(RuntimeError, match="expected one tensor"):
            pg.allreduce([t, t], dist.AllreduceOptions())
        # the group still works, and nothing moved
        dist.all_reduce(t)
        errors.expect(t.tolist() == [float(n)] * 4, f"after the refusals: {t}")
        errors.verify()

    def test_a_thousand_operations(self, errors) -> None:
        """torch's stress loop: 1000 operations in flight, then all waited for."""
        n, me = dist.get_world_size(), dist.get_rank()
        ts = [torch.full((8,), float(i + me)) for i in range(1000)]
        t0 = time.perf_counter()
        works = [dist.all_reduce(t, async_op=True) for t in ts]
        for w in works:
            w.wait()
        seconds = time.perf_counter() - t0
        bad = [i for i, t in enumerate(ts) if t[0].item() != n * i + n * (n - 1) / 2]
        errors.expect(not bad, f"wrong sums at {bad[:5]}")
        errors.expect(seconds < 60, f"1000 operations took {seconds:.1f} s")
        errors.verify()

    def test_groups_have_their_own_communicator(self, errors, pg) -> None:
        n, me = dist.get_world_size(), dist.get_rank()
        evens = list(range(0, n, 2))
        group = dist.new_group(evens)
        single = dist.new_group([n - 1])
        if me in evens:
            errors.expect(
                isinstance(group, ht.ProcessGroupHetcomm)
                and group.comm is not pg.comm
                and group.size() == len(evens),
                f"subgroup {group}",
            )
            t = torch.full((2,), float(me))
            dist.all_reduce(t, group=group)
            errors.expect(t.tolist() == [float(sum(evens))] * 2, f"subgroup all_reduce: {t}")
            errors.expect(f"group '{group.comm.name}'" in str(group.comm.plan), "its own plan")
        else:
            errors.expect(group == dist.GroupMember.NON_GROUP_MEMBER, "not a member")
        if me == n - 1:
            t = torch.ones(1)
            dist.all_reduce(t, group=single)
            errors.expect(t.tolist() == [1.0], "a group of one")
        errors.verify()

    def test_split_group(self, errors, pg) -> None:
        """The group's own split_group, as torch's dist.split_group calls it (that function
        itself needs an accelerator and a bound device): each rank passes its own piece, ranks in
        no piece pass the first one and get None."""
        n, me = dist.get_world_size(), dist.get_rank()
        errors.expect(pg._get_backend(torch.device("cpu")).supports_splitting, "can split")
        halves = [list(range(0, n, 2)), list(range(1, n, 2))]
        mine = halves[me % 2]
        sub = pg.split_group(
            mine, timeout=timedelta(seconds=60), group_name=f"half{me % 2}", group_desc="halves"
        )
        ok = (
            isinstance(sub, ht.ProcessGroupHetcomm)
            and sub.size() == len(mine)
            and sub.rank() == mine.index(me)
            and sub.group_name == f"half{me % 2}"
            and sub.group_desc == "halves"
            and sub.timeout_s == 60
            and sub.comm.config.timeout == 60
        )
        errors.expect(ok, f"split_group gave {sub}")
        if sub is not None:
            t = torch.tensor([float(me)])
            sub.allreduce([t]).wait()
            errors.expect(t.item() == sum(mine), f"all_reduce in the split: {t.item()}")
            sub.shutdown()
        first = pg.split_group([0, 1])  # ranks 2 .. n-1 are in no piece
        errors.expect((first is None) == (me > 1), f"rank {me}: split_group([0, 1]) gave {first}")
        if first is not None:
            first.shutdown()
        errors.verify()

    def test_device_mesh(self, errors) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        n, me = dist.get_world_size(), dist.get_rank()
        shape = (2, n // 2) if n % 2 == 0 else (1, n)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
        coords = divmod(me, shape[1])  # row-major: tp fastest
        for dim, name in enumerate(("dp", "tp")):
            group = mesh.get_group(name)
            errors.expect(isinstance(group, ht.ProcessGroupHetcomm), f"{name}: {group}")
            t = torch.tensor([float(me)])
            dist.all_reduce(t, group=group)
            if dim == 0:
                want = sum(r * shape[1] + coords[1] for r in range(shape[0]))
            else:
                want = sum(coords[0] * shape[1] + c for c in range(shape[1]))
            errors.expect(t.item() == want, f"mesh dim {name}: {t.item()} != {want}")
        errors.verify()
