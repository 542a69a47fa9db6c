"""The isolation pool with real failing workloads (tests/failing_workload.py): each failure is a WorkloadFailed
naming its status, the workload's part and the estimator's stage; the advisor's own errors come back as
raised; preset workers stay warm, file workers are retired; concurrent calls get their own workers; a full
pool says when to retry; and no process of the pool outlives its test, nor any after close()."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import failing_workload  # tests/ is on sys.path (its conftest's folder); a worker imports it by this name
import pytest

from advisor import isolation
from advisor.errors import SpecError, WorkloadFailed
from advisor.estimate import EstimateOptions, EstimateRequest
from advisor.estimate.stages import listening
from advisor.isolation.forkserver import ForkServer, get_server, use_shared
from advisor.isolation.pool import ALLOC_LOG, PRELOAD, PoolFull, WorkerPool, fork_server, use_shared_server
from advisor.workload import describe_workload

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
FAILING = f"{TESTS / 'failing_workload.py'}:build"
EXITING = f"{TESTS / 'exiting_workload.py'}:build"
TIMEOUT_S = 120.0  # for calls that must succeed: far above what they take
CAP = 1500 << 20  # the memory cap of the hog's test: well above a worker's own resident set (torch loaded)


def _descendants(pid: int) -> set[int]:
    """Every live (not zombie) process below `pid`."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
        except OSError:
            continue  # exited while we looked
        if state != "Z":
            children.setdefault(int(ppid), []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _settles_to(allowed: set[int], grace_s: float = 10.0) -> set[int]:
    """The fork server's processes outside `allowed` once they stop changing (or `grace_s` passed): killed
    workers take a moment to be reaped."""
    server = fork_server().proc.pid
    deadline = time.monotonic() + grace_s
    while True:
        extra = _descendants(server) - allowed
        if not extra or time.monotonic() > deadline:
            return extra
        time.sleep(0.1)


@pytest.fixture
def make_pool():
    """WorkerPool(size, queue) for the test; afterwards only their idle workers are left, and after close() none
    (beside what other pools of this process, such as the default one, kept from earlier tests)."""
    pools: list[WorkerPool] = []
    before = _descendants(fork_server().proc.pid)

    def make(size: int = 1, queue: int | None = None) -> WorkerPool:
        pools.append(WorkerPool(size, queue))
        return pools[-1]

    yield make
    idle = {w.proc.pid for p in pools for w in p._idle}
    left = _settles_to(before | idle)
    for p in pools:
        p.close()
    assert not left, f"processes of the pool other than its idle workers {sorted(idle)}: {sorted(left)}"
    assert not _settles_to(before), "processes of the pool left after close()"


def _pid(pool: WorkerPool) -> int:
    return pool.call(os.getpid, what="the pid", stage="asking", timeout_s=TIMEOUT_S, memory_cap_bytes=4 << 30)


def _estimate(pool: WorkerPool, mode: str, **kw) -> None:
    isolation.estimate(FAILING, "cpu", EstimateRequest(batch_size=8), EstimateOptions(calibrate=False),
                       workload_args={"mode": mode}, pool=pool, **kw)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_loss_that_aborts_is_a_crash_named_by_its_signal_part_and_stage(make_pool):
    pool = make_pool()
    with pytest.raises(WorkloadFailed) as info:
        _estimate(pool, "abort")
    exc = info.value
    assert exc.status == "crashed"
    assert str(exc).startswith("the workload's loss crashed (SIGABRT) while tracing failing-abort at batch 8"), exc
    # the failure crosses processes as it is: the API's worker threads and the tuner's Ray workers pickle it
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is WorkloadFailed and (str(back), back.status, back.detail) == (str(exc), "crashed", exc.detail)


def test_a_loss_that_hangs_is_killed_at_the_time_limit(make_pool):
    pool = make_pool()
    t0 = time.monotonic()
    with pytest.raises(WorkloadFailed) as info:
        _estimate(pool, "hang", timeout_s=3)
    assert info.value.status == "timeout"
    assert str(info.value).startswith("the workload's loss did not finish within 3 s while tracing failing-hang"), \
        info.value
    assert time.monotonic() - t0 < 3 + 30  # the limit, plus a worker's start on a busy machine at most


def test_a_model_that_outgrows_the_memory_cap_is_killed_as_oom(make_pool):
    pool = make_pool()
    with pytest.raises(WorkloadFailed) as info:
        isolation.describe(FAILING, {"mode": "hog"}, memory_cap_bytes=CAP, timeout_s=60, pool=pool)
    exc = info.value
    assert exc.status == "oom"
    assert str(exc).startswith("the workload's model reached "), exc
    assert f"past the memory cap of {CAP / 2**20:,.0f} MiB, while loading {FAILING}" in str(exc)


def test_a_loss_that_raises_is_an_error_with_its_message_stage_and_traceback(make_pool):
    pool = make_pool()
    with pytest.raises(WorkloadFailed) as info:
        isolation.run_isolated(failing_workload.one_step, FAILING, {"mode": "raise"}, 8, spec=FAILING,
                               what="the step", stage="starting", timeout_s=TIMEOUT_S, pool=pool)
    exc = info.value
    assert exc.status == "error"
    # the stage is the one the worker reported last, not the one the call started with
    assert str(exc) == ("the workload's loss raised RuntimeError: the loss failed on purpose "
                        "while one real step at batch 8"), exc
    assert "failing_workload.py" in exc.detail and "the loss failed on purpose" in exc.detail


def test_a_workload_that_exits_is_an_error_naming_the_part_it_exited_in(make_pool):
    pool = make_pool()
    with pytest.raises(WorkloadFailed) as info:
        isolation.describe(EXITING, pool=pool)
    assert info.value.status == "error"
    assert str(info.value) == f"the workload's import exited (SystemExit: 3) while loading {EXITING}", info.value
    with pytest.raises(WorkloadFailed) as info:
        _estimate(pool, "exit")
    assert info.value.status == "error"
    assert str(info.value).startswith("the workload's loss exited (SystemExit: 3) while tracing failing-exit"), \
        info.value


def test_the_advisors_own_error_comes_back_as_raised(make_pool):
    pool = make_pool()
    with pytest.raises(SpecError, match="no-such-preset"):
        isolation.describe("no-such-preset", pool=pool)
    assert isolation.describe("tiny-mlp", pool=pool).name == "tiny-mlp"  # the pool serves on


def test_a_preset_call_keeps_its_worker_warm_and_a_file_call_retires_it(make_pool):
    pool = make_pool()
    first = _pid(pool)
    assert isolation.describe("tiny-mlp", pool=pool).name == "tiny-mlp"
    assert _pid(pool) == first  # the same worker, warm
    info = isolation.run_isolated(describe_workload, FAILING, {"mode": "ok"}, spec=FAILING, what="loading",
                                  stage="loading", pool=pool)
    assert info.name == "failing-ok"
    assert not _alive(first)  # the worker that ran the file's code is gone
    assert _pid(pool) != first


def test_a_call_runs_in_the_callers_environment_as_it_is_then(make_pool, monkeypatch):
    pool = make_pool()
    first = _pid(pool)
    monkeypatch.setenv("ADVISOR_ISOLATION_TEST_MARK", "set after the worker started")
    seen = pool.call(os.getenv, "ADVISOR_ISOLATION_TEST_MARK", what="the variable", stage="reading",
                     timeout_s=TIMEOUT_S, memory_cap_bytes=4 << 30)
    assert seen == "set after the worker started"  # not the warm worker's older environment
    assert _pid(pool) != first


def test_concurrent_calls_run_in_different_workers(make_pool):
    pool = make_pool(2)
    results: list[tuple[int, float, float]] = []

    def call() -> None:
        results.append(pool.call(failing_workload.pid_after, 2.0, what="the wait", stage="waiting",
                                 timeout_s=TIMEOUT_S, memory_cap_bytes=4 << 30))

    threads = [threading.Thread(target=call) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    (pid_a, start_a, end_a), (pid_b, start_b, end_b) = results
    assert pid_a != pid_b and os.getpid() not in (pid_a, pid_b)
    assert start_a < end_b and start_b < end_a  # at the same time, not one after the other


def test_a_full_pool_says_when_to_retry(make_pool):
    pool = make_pool(1, queue=1)
    results: list[tuple[int, float, float]] = []

    def call() -> None:
        results.append(pool.call(failing_workload.pid_after, 1.5, what="the wait", stage="waiting",
                                 timeout_s=TIMEOUT_S, memory_cap_bytes=4 << 30))

    threads = [threading.Thread(target=call) for _ in range(2)]  # one runs, one waits in the queue
    for t in threads:
        t.start()
    time.sleep(0.5)
    with pytest.raises(PoolFull) as info:
        _pid(pool)
    assert isinstance(info.value.retry_after_s, int) and info.value.retry_after_s >= 1
    for t in threads:
        t.join(TIMEOUT_S)
    (pid_a, _, end_a), (pid_b, start_b, _) = sorted(results, key=lambda r: r[1])
    assert pid_a == pid_b and start_b >= end_a  # the queued call ran after, in the same warm worker
    assert _pid(pool) == pid_a  # and the pool takes calls again


def test_the_workers_stages_reach_the_callers_listener(make_pool):
    pool = make_pool()
    seen: list[str] = []
    with listening(seen.append):
        est = isolation.estimate("tiny-mlp", "cpu", EstimateRequest(batch_size=8), EstimateOptions(calibrate=False),
                                 pool=pool)
    assert est.workload == "tiny-mlp" and est.request.batch_size == 8 and est.total_bytes > 0
    assert "tracing tiny-mlp at batch 8" in seen, seen


def test_a_reusing_estimate_of_a_preset_answers_again_untraced_until_an_input_changes(make_pool, monkeypatch):
    pool = make_pool()
    isolation._ESTIMATES.clear()  # what earlier tests of this process kept
    request, options = EstimateRequest(batch_size=5), EstimateOptions(calibrate=False)
    seen: list[str] = []

    def traces(workload: str = "tiny-mlp", req: EstimateRequest = request, opts: EstimateOptions = options,
               **kw) -> int:
        before = len(seen)
        isolation.estimate(workload, "cpu", req, opts, pool=pool, **kw)
        return sum(s.startswith("tracing") for s in seen[before:])

    with listening(seen.append):
        assert traces(reuse=True) == 1
        first = isolation.estimate("tiny-mlp", "cpu", request, options, pool=pool, reuse=True)
        again = isolation.estimate("tiny-mlp", "cpu", request, options, pool=pool, reuse=True)
        assert again == first and again is not first
        assert traces(reuse=True) == 0  # the same inputs: the earlier answer
        assert traces() == 1  # a caller that does not reuse: traced again
        assert traces(reuse=True, req=EstimateRequest(batch_size=7)) == 1  # another batch
        assert traces(reuse=True, opts=EstimateOptions(calibrate=False, margin=0.2)) == 1  # another margin
        monkeypatch.setenv("ADVISOR_ISOLATION_TEST_MARK", "another environment")
        assert traces(reuse=True) == 1
        assert traces(reuse=True, workload=FAILING, workload_args={"mode": "ok"}) == 1
        assert traces(reuse=True, workload=FAILING, workload_args={"mode": "ok"}) == 1  # a file's code may change


def test_a_fork_server_outlives_the_thread_that_started_it():
    """A pool's first caller (an API request's thread, a warm-up thread) may end long before the process does."""
    box: dict[str, ForkServer] = {}

    def start() -> None:
        box["server"] = ForkServer(["json"])
        box["server"].wait_ready(60)

    thread = threading.Thread(target=start)
    thread.start()
    thread.join(60)
    server = box["server"]
    try:
        time.sleep(0.5)
        assert server.alive(), f"the fork server died with its starting thread (exit {server.proc.poll()})"
        child = server.spawn("os:_exit", [5], {})
        child.join(30)
        assert child.exitcode == 5
    finally:
        if server.proc.poll() is None:
            server.close()


def test_a_fork_server_and_what_it_forked_go_when_its_client_is_killed():
    # the client's own fork holds the server's stdin open: the server must see its client die all the same
    script = ("import os, time\nfrom advisor.isolation.forkserver import ForkServer\n"
              "server = ForkServer(['json']); assert server.wait_ready(60)\n"
              "child = server.spawn('time:sleep', [600], {})\n"
              "holder = os.fork()\nif holder == 0: time.sleep(600); os._exit(0)\n"
              "print(server.proc.pid, child.pid, holder, flush=True); time.sleep(600)\n")
    client = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        *pids, holder = [int(p) for p in client.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        client.kill()
        client.wait(30)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(p) for p in pids), f"left running after their client was killed: {pids}"
    finally:
        client.kill()
        if "holder" in locals():
            os.kill(holder, signal.SIGKILL)


def test_a_fork_server_whose_client_exits_while_it_imports_goes_quietly():
    # a run that ends at once (a bad store) while its server still imports: no traceback reaches the user
    script = "from advisor.isolation.forkserver import ForkServer\nprint(ForkServer(['torch']).proc.pid, flush=True)\n"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    server = int(done.stdout.split()[0])  # the server holds the pipes open until it exits: run() waited for it
    assert not _alive(server) and done.returncode == 0 and done.stderr == "", done.stderr


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def test_a_client_that_attaches_forks_through_the_server_and_what_it_forked_goes_when_it_lets_go():
    """Another process's client (a tuner's Ray actor) of a server: its forks are the server's, their exits come back
    to it alone, and what it forked is killed when it lets go; the server and its owner's forks live on."""
    owner = ForkServer(["json"])
    kept = None
    try:
        attached = ForkServer.attach(owner.address)
        assert attached.wait_ready(60) and owner.wait_ready(1)
        kept = owner.spawn("time:sleep", [600], {})
        quick = attached.spawn("os:_exit", [5], {})
        quick.join(30)
        assert quick.exitcode == 5 and owner.exits.get(quick.pid) is None
        child = attached.spawn("time:sleep", [600], {})
        assert _ppid(child.pid) == owner.proc.pid and child.pid != kept.pid
        attached.close()
        deadline = time.monotonic() + 10
        while _alive(child.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child.pid), "a detached client's fork was left running"
        assert _alive(kept.pid) and owner.alive() and not attached.alive()
    finally:
        if kept is not None:
            os.kill(kept.pid, signal.SIGKILL)
        owner.close()
    assert not Path(owner.address).parent.exists()  # the socket's private directory goes with the server


def test_a_pool_forks_through_the_shared_server_while_it_answers_and_through_its_own_after():
    """`use_shared`: the pool's workers are the other process's server's forks; a shared server that does not
    answer (gone) leaves the process to start its own."""
    owner = ForkServer(PRELOAD, ALLOC_LOG)  # torch and the estimator imported: seconds
    pool = WorkerPool(1)
    try:
        use_shared_server(owner.address)
        assert pool.call(os.getppid, what="the call", stage="asking", timeout_s=TIMEOUT_S,
                         memory_cap_bytes=4 << 30) == owner.proc.pid
        assert fork_server().proc is None  # attached: this process started no server of its own
    finally:
        pool.close()
        owner.close()
    use_shared(["json"], False, str(Path(owner.address).parent / "gone"))
    own = get_server(["json"])
    try:
        assert own.proc is not None and own.wait_ready(60)
        use_shared(["json"], False, str(Path(owner.address).parent / "gone"))  # the next trial names it again
        assert get_server(["json"]) is own  # kept, not started again for another try
    finally:
        own.close()


def test_a_pool_whose_fork_server_died_serves_on_from_a_new_one(make_pool):
    pool = make_pool()
    first = _pid(pool)
    server = fork_server()
    server.proc.kill()  # its workers die with it (their parent-death signal), the idle one included
    server.proc.wait(30)
    assert _pid(pool) != first  # a new worker of a new server, not a send to the dead one
    assert fork_server().proc.pid != server.proc.pid
