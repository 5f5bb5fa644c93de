"""dsv4_ort.runtime.pipeline with one Ray actor per stage, on a Ray instance this module starts on 127.0.0.1 (no
dashboard, no usage reporting, every server on loopback): 2- and 3-stage exports of the tiny preset give the single
graph's float32 logits bit for bit (prefill, chunked prefill, decode of rows at different positions, micro-batched
decode, greedy generation); a killed stage actor and a stuck one are a StageError from the next call, within
seconds. Skipped only where ray is not installed (``pip install '.[cluster]'``)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from model_fixtures import random_ids, require_library

ray = pytest.importorskip("ray", reason="the Ray backend needs ray (pip install 'dsv4-ort[cluster]')")

from dsv4_ort.export import export_model  # noqa: E402
from dsv4_ort.runtime import Session  # noqa: E402
from dsv4_ort.runtime.pipeline import PipelineSession, StageError, start_local_ray  # noqa: E402

# every pipeline call waits at most this long (a hang fails the test instead of blocking the run)
CALL_TIMEOUT = 60.0
# opening a pipeline waits longer. Trap: now and then a Ray worker process dies while starting (seen with ASan
# preloaded, tests/sanitize.sh); Ray notices only when the worker has not registered within its own 60 s
# (worker_register_timeout_seconds) and then starts another for the stage actor, so a load can take just over 60 s.
LOAD_TIMEOUT = 180.0
# batch invariance up to this many rows on the pipeline and the single graph: micro-batches of a decode step then
# give each row what the whole batch gives it, so micro-batched logits compare bitwise with the single graph's
INVARIANT = 4


@pytest.fixture(scope="module")
def ray_cluster():
    """One Ray instance for the module, on loopback: 4 logical CPUs (a 3-stage pipeline reserves 3; the machine
    may have 2 cores, the stages run one token at a time), 256 MiB object store."""
    if ray.is_initialized():
        ray.shutdown()
    start_local_ray(4, object_store_memory=256 << 20)
    try:
        addresses = {n["NodeManagerAddress"] for n in ray.nodes()}
        assert addresses == {"127.0.0.1"}, addresses
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def exports(cache, tmp_path_factory):
    require_library()
    ck = cache.checkpoint("tiny")
    root = tmp_path_factory.mktemp("ray-stages")
    out = {1: export_model(ck, root / "one", logits="all", max_seq_len=256, progress=False).parent}
    for n in (2, 3):
        out[n] = export_model(ck, root / f"staged-{n}", logits="all", max_seq_len=256, progress=False,
                              stages=n).parent
    return out


def _listening_addresses() -> set:
    """Local addresses of the TCP sockets listening in this process and its descendants (Ray's GCS, raylet, object
    manager, workers), from /proc: IPv4 as dotted quads, IPv6 as 32 hex digits."""
    children: dict = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()  # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        except OSError:
            continue
        children.setdefault(int(text.rsplit(")", 1)[1].split()[1]), []).append(int(stat.parent.name))
    pids, todo = set(), [os.getpid()]
    while todo:
        p = todo.pop()
        pids.add(p)
        todo += children.get(p, [])
    inodes = set()
    for p in pids:
        try:
            for fd in Path(f"/proc/{p}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # LISTEN
                addr = f[1].split(":")[0]
                out.add(".".join(str(int(addr[i:i + 2], 16)) for i in (6, 4, 2, 0)) if len(addr) == 8 else addr)
    return out


def _loopback(addr: str) -> bool:
    # IPv6 in /proc is four little-endian 32-bit words: ::1 and ::ffff:127.x.y.z
    return addr.startswith("127.") or addr == "00000000000000000000000001000000" \
        or (addr.startswith("0000000000000000FFFF0000") and addr.endswith("7F"))


def _pipeline(path, **kw) -> PipelineSession:
    """A Ray pipeline over ``path`` whose loading may take LOAD_TIMEOUT and whose calls then answer within
    CALL_TIMEOUT."""
    kw.setdefault("batch_invariant", INVARIANT)
    staged = PipelineSession(path, backend="ray", intra_op_threads=1, num_cpus=1, timeout=LOAD_TIMEOUT, **kw)
    staged.timeout = CALL_TIMEOUT
    return staged


@pytest.mark.parametrize("n", [2, 3])
def test_ray_stages_give_the_single_graph_bitwise(ray_cluster, exports, n):
    one = Session(exports[1], intra_op_threads=1, batch_invariant=INVARIANT)
    with _pipeline(exports[n]) as staged:
        assert staged.n_stages == n and staged.micro_batches == n
        assert len({s["pid"] for s in staged.stages} | {os.getpid()}) == n + 1  # one process per stage
        listening = _listening_addresses()
        assert listening and all(_loopback(a) for a in listening), listening
        ids = random_ids(one.vocab_size, (3, 37), seed=11)
        sa, sb = one.new_state(3), staged.new_state(3)
        np.testing.assert_array_equal(one.forward(ids[:, :20], sa), staged.forward(ids[:, :20], sb))
        # chunked prefill (chunk c + 1 enters stage 0 while chunk c is further down), then decode with the rows at
        # different positions, in micro-batches of 1-2 rows
        np.testing.assert_array_equal(one.forward(ids[:, 20:], sa, chunk_size=8),
                                      staged.forward(ids[:, 20:], sb, chunk_size=8))
        sa.positions[1] -= 5
        sb.positions[1] -= 5
        tok = np.array([[5], [6], [7]], np.int64)
        for _ in range(4):
            la, lb = one.forward(tok, sa), staged.forward(tok, sb)
            np.testing.assert_array_equal(la, lb)
            tok = la[:, -1].argmax(-1)[:, None]
        # the state rows live in the actors: a row copy there and here stays in step with the single graph
        sa.copy_row(0, 2)
        sb.copy_row(0, 2)
        np.testing.assert_array_equal(one.forward(tok, sa), staged.forward(tok, sb))
        name = one.meta["state"]["tensors"][-1]["input"]
        np.testing.assert_array_equal(sa.buffer(name), sb.buffer(name))
        assert one.generate([1, 2, 3], 16) == staged.generate([1, 2, 3], 16)


def test_ray_micro_batched_decode(ray_cluster, exports):
    """Decode of 4 rows at different positions in 1, 2 and 4 micro-batches: bitwise the single graph's whole
    batch with batch invariance; without it, bitwise the single graph run on the same groups of rows."""
    one = Session(exports[1], intra_op_threads=1, batch_invariant=INVARIANT)
    rows, prompt = 4, random_ids(one.vocab_size, (4, 21), seed=3)

    def decode(forward, state, steps=3):
        out, tok = [], np.array([[9], [8], [7], [6]], np.int64)
        for _ in range(steps):
            out.append(forward(tok, state))
            tok = out[-1][:, -1].argmax(-1)[:, None]
        return np.concatenate(out, axis=1)

    def prefilled(sess, ids):
        st = sess.new_state(ids.shape[0])
        sess.forward(ids, st)
        st.positions[:] -= np.arange(ids.shape[0])  # rows at positions 21, 20, 19, 18
        return st

    want = decode(one.forward, prefilled(one, prompt))
    got = {}
    with _pipeline(exports[2], micro_batches=4) as staged:
        for m in (1, 2, 4):
            staged.micro_batches = m
            assert len(staged._groups(rows)) == m
            got[m] = decode(staged.forward, prefilled(staged, prompt))
    for m in (1, 2, 4):
        np.testing.assert_array_equal(got[m], want, err_msg=f"{m} micro-batches")

    # no batch invariance: two groups of two rows give the single graph's decode of each half on its own (the
    # prefill of the 4 rows stays whole on both)
    plain = Session(exports[1], intra_op_threads=1, batch_invariant=0)
    st = prefilled(plain, prompt)
    views = [st.rows(0, 2), st.rows(2, 4)]
    want = decode(lambda tok, _: np.concatenate([plain.forward(tok[a:a + 2], v) for a, v in zip((0, 2), views)]),
                  st)
    with _pipeline(exports[2], micro_batches=2, batch_invariant=0) as staged:
        np.testing.assert_array_equal(decode(staged.forward, prefilled(staged, prompt)), want)


def test_ray_killed_stage_is_a_clear_error(ray_cluster, exports):
    staged = _pipeline(exports[2])
    try:
        st = staged.new_state(2)
        staged.forward(random_ids(staged.vocab_size, (2, 5), seed=1), st)
        os.kill(staged.stages[1]["pid"], signal.SIGKILL)  # the stage's process dies (as with a lost node)
        t0 = time.monotonic()
        with pytest.raises(StageError, match=r"pipeline stage 1 died .*restart the pipeline") as e:
            staged.forward(np.array([[1], [2]]), st)
        assert e.value.stage == 1
        assert time.monotonic() - t0 < 30
        # every later call fails at once with the same error, new states included
        t0 = time.monotonic()
        for call in (lambda: staged.forward(np.array([[1], [2]]), st), lambda: staged.new_state(1)):
            with pytest.raises(StageError, match="pipeline stage 1 died"):
                call()
        assert time.monotonic() - t0 < 1
    finally:
        staged.close()
    with pytest.raises(StageError, match="closed"):
        staged.new_state(1)
    # recovery as documented: a new pipeline over the same export
    with _pipeline(exports[2]) as again:
        st = again.new_state(1)
        assert again.forward([[1, 2, 3]], st).shape == (1, 3, again.vocab_size)


def test_ray_stuck_stage_times_out(ray_cluster, exports):
    staged = _pipeline(exports[2])
    pid = staged.stages[1]["pid"]
    try:
        st = staged.new_state(1)
        staged.timeout = 3  # loading took the long one; a step must answer within 3 s
        os.kill(pid, signal.SIGSTOP)  # alive but not answering
        t0 = time.monotonic()
        with pytest.raises(StageError, match="no answer from the stages within 3 s"):
            staged.forward([[1, 2, 3]], st)
        assert time.monotonic() - t0 < 10
    finally:
        os.kill(pid, signal.SIGCONT)
        staged.close()
