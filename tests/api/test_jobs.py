"""Tune jobs outside the request: the queue on real SQLite and PostgreSQL (claims by concurrent
processes, device slots, recovery of a dead worker's jobs), and `advisor serve` running jobs over
HTTP with real trials, cancelling one, and resuming one after the server is killed."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

# settle_s 0: the trials start at once on a machine the suite keeps busy (they are checked for what
# they store, not how fast they ran)
JOB = {"workload": "tiny-mlp", "hardware": "cpu", "space": "tiny", "min_time_s": 0.3, "trial_timeout_s": 120,
       "settle_s": 0}


def _claim_all(url: str, out) -> None:  # noqa: ANN001 (a multiprocessing queue)
    from advisor.store import open_store
    from advisor.store.jobs import JobQueue

    with open_store(url) as store:
        queue = JobQueue(store)
        while (job := queue.claim_next(store.owner, 1)) is not None:
            out.put((job.id, store.owner))


def test_concurrent_workers_claim_each_job_once(db_url):
    from advisor.store import open_store
    from advisor.store.jobs import JobQueue

    with open_store(db_url) as store:
        queue = JobQueue(store)
        ids = {queue.submit({"n": i}, 1).id for i in range(12)}
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_claim_all, args=(db_url, out)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    claims = [out.get(timeout=5) for _ in range(out.qsize())]
    assert sorted(c[0] for c in claims) == sorted(ids)  # every job once, none twice
    with open_store(db_url) as store:
        jobs, total = JobQueue(store).list(limit=100)
    assert total == 12 and all(j.status == "running" and j.attempts == 1 for j in jobs)
    assert {j.owner for j in jobs} == {c[1] for c in claims}


def test_device_slots_and_recovery_of_a_dead_workers_jobs(db_url):
    from advisor.store import open_store
    from advisor.store.jobs import JobQueue

    with open_store(db_url) as store:
        queue = JobQueue(store)
        big = queue.submit({"n": "big"}, 2)
        small = queue.submit({"n": "small"}, 1)
        assert queue.claim_next("w:1", 1).id == small.id  # the older job needs 2 devices: skipped
        assert queue.claim_next("w:1", 1) is None
        assert queue.finish(small.id, "finished", owner="w:1") and not queue.finish(small.id, "failed")
        # a worker of this host whose process is gone: its running job is queued again, its cancel ends
        dead = mp.get_context("spawn").Process(target=time.sleep, args=(0,))
        dead.start()
        dead.join()
        owner = f"{store.owner.rpartition(':')[0]}:{dead.pid}"
        assert queue.claim_next(owner, 2).id == big.id
        cancelled = queue.submit({"n": "c"}, 1)
        assert queue.claim_next(owner, 1).id == cancelled.id
        queue.cancel(cancelled.id)
        assert queue.get(cancelled.id).status == "cancelling"
        assert queue.recover() == [big.id]
        assert queue.get(big.id).status == "queued" and queue.get(big.id).owner is None
        assert queue.get(cancelled.id).status == "cancelled"
        again = queue.claim_next(store.owner, 2)
        assert again.id == big.id and again.attempts == 2
        # a live worker on another host is trusted until its heartbeat is stale
        queue.finish(again.id, "queued", owner=store.owner)
        assert queue.claim_next("elsewhere:1", 2).id == big.id
        assert queue.recover() == []
        assert queue.recover(stale_s=0.0) == [big.id]


def _wait(client, job_id: str, until, timeout: float, what: str) -> dict:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    job = None
    while time.monotonic() < deadline:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if until(job):
            return job
        time.sleep(1.0)
    raise AssertionError(f"job {job_id} did not reach {what} in {timeout} s; last: {job}")


def _job_log(server, job_id: str) -> str:  # noqa: ANN001
    """The tail of the job process's log on the worker (its traceback, where it crashed), for a failure's
    message: the job's status names the exception only."""
    path = server.data_dir / "jobs" / f"{job_id}.log"
    return path.read_text(errors="replace")[-4000:] if path.exists() else f"(no log at {path})"


def _trials(client, study_id: int) -> list[dict]:  # noqa: ANN001
    return client.get(f"/v1/studies/{study_id}/trials", params={"limit": 500}).json()["items"]


def test_a_job_over_http_runs_real_trials_and_its_results_are_served(sqlite_url, serve):
    server = serve(sqlite_url)
    with server.client() as c:
        r = c.post("/v1/tune", json={**JOB, "trials": 3})
        assert r.status_code == 202, r.text
        job_id = r.json()["job_id"]
        job = _wait(c, job_id, lambda j: j["status"] in ("finished", "failed", "cancelled"), 400, "an end")
        assert job["status"] == "finished", (job, _job_log(server, job_id))
        assert job["progress"] == {"done": 3, "total": 3, "fraction": 1.0}
        results = c.get("/v1/results", params={"study": job["study_name"]}).json()
        assert results["total"] == 3
        ok = [t for t in results["items"] if t["status"] == "ok"]
        assert ok and all(t["samples_per_s"] > 0 and t["peak_memory_bytes"] > 0 for t in ok)
        assert job["best"]["trial_id"] == max(ok, key=lambda t: t["samples_per_s"])["id"]
        from advisor.store import TrialQuery, open_store

        with open_store(sqlite_url) as store:  # the job's settle_s reached its trials: 0, they did not look
            assert all(t.result.others_busy is None for t in store.query_trials(TrialQuery(study=job["study_name"])))
        metrics = c.get("/metrics").text
        assert 'advisor_jobs{status="finished"} 1.0' in metrics


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _job_pids(server_pid: int) -> list[int]:
    """The server's job processes (`python -m api.jobs`, children of the server)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmdline = f.read()
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if b"api.jobs" in cmdline and ppid == server_pid:
                pids.append(int(entry))
    return pids


def test_cancel_stops_the_trials_and_keeps_the_study(sqlite_url, serve):
    server = serve(sqlite_url)
    with server.client() as c:
        job_id = c.post("/v1/tune", json={**JOB, "trials": 12}).json()["job_id"]
        job = _wait(c, job_id, lambda j: j["progress"]["done"] >= 1, 300, "one finished trial")
        assert _job_pids(server.proc.pid)
        r = c.delete(f"/v1/jobs/{job_id}")
        assert r.status_code == 202 and r.json()["status"] in ("cancelling", "cancelled")
        job = _wait(c, job_id, lambda j: j["status"] == "cancelled", 60, "cancelled")
        deadline = time.monotonic() + 20
        while _job_pids(server.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _job_pids(server.proc.pid)  # the job process and its trials are gone
        study = c.get(f"/v1/studies/{job['study_id']}").json()  # the study stays, with what was measured
        trials = _trials(c, job["study_id"])
        assert study["trial_counts"].get("ok", 0) >= 1 and job["progress"]["done"] < 12
        assert not [t for t in trials if t["status"] == "running"]
        assert c.delete(f"/v1/jobs/{job_id}").status_code == 409


def test_jobs_survive_restarts_and_resume_their_study(sqlite_url, serve):
    # 1. A server that runs no jobs accepts one: it stays queued, and stays queued past a restart.
    first = serve(sqlite_url, ADVISOR_RUN_JOBS="false")
    with first.client() as c:
        job_id = c.post("/v1/tune", json={**JOB, "trials": 4}).json()["job_id"]
        time.sleep(2)
        assert c.get(f"/v1/jobs/{job_id}").json()["status"] == "queued"
    first.kill()
    # 2. A server with a worker takes it; killed (SIGKILL) mid-study, its job process dies with it.
    second = serve(sqlite_url)
    with second.client() as c:
        job = _wait(c, job_id, lambda j: j["progress"]["done"] >= 1, 300, "one finished trial")
        assert job["status"] == "running"
    pids = _job_pids(second.proc.pid)
    assert pids
    second.kill()
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(_alive(p) for p in pids)
    # 3. The next server finds the job orphaned, queues it again and resumes the same study.
    third = serve(sqlite_url)
    with third.client() as c:
        job = _wait(c, job_id, lambda j: j["status"] in ("finished", "failed"), 400, "an end")
        assert job["status"] == "finished", (job, _job_log(third, job_id))
        from advisor.store import open_store
        from advisor.store.jobs import JobQueue
        from api.jobs import TRANSIENT_ATTEMPTS

        # the restart's claim; one more where a database lock outlived its timeout
        with open_store(sqlite_url) as store:
            assert 2 <= JobQueue(store).get(job_id).attempts <= TRANSIENT_ATTEMPTS, _job_log(third, job_id)
        trials = _trials(c, job["study_id"])
        measured = [t for t in trials if t["status"] in ("ok", "oom", "pruned")]
        assert len({t["config_hash"] for t in measured}) == len(measured) == 4  # none measured twice
        assert all(t["status"] != "running" for t in trials)


def test_a_lock_held_past_the_busy_timeout_is_a_transient_error_and_a_bug_is_not(tmp_path):
    """What sends a crashed job back to the queue (api.jobs.transient): real Optuna on a real SQLite file
    that another connection holds locked answers StorageInternalError from sqlite3's 'database is
    locked'; an error of the program itself is not transient."""
    import sqlite3

    import optuna
    import pytest

    from api.jobs import _what, transient

    db = tmp_path / "optuna.db"
    storage = optuna.storages.RDBStorage(f"sqlite:///{db}", engine_kwargs={"connect_args": {"timeout": 0.2}})
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(optuna.exceptions.StorageInternalError) as locked:
            storage.create_new_study([optuna.study.StudyDirection.MAXIMIZE], "s")
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert transient(locked.value)
    assert "database is locked" in _what(locked.value), _what(locked.value)
    try:
        raise KeyError("no such knob")
    except KeyError as bug:
        assert not transient(bug)
    # once the lock is gone the same storage works again: what the job's next attempt relies on
    assert storage.create_new_study([optuna.study.StudyDirection.MAXIMIZE], "s") >= 0
