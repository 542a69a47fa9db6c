"""The service never runs a workload's code in its own process: over real HTTP against `advisor serve`,
workloads that abort, hang, raise, exit or outgrow the memory cap (tests/failing_workload.py) answer 422 with
the reason, the server keeps answering meanwhile and afterwards, a full pool answers 503 with
Retry-After, and concurrent cold requests never take an HTTP worker process down. workload_args are
bounded (count, key, value) with a 422 past the bounds."""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

TESTS = Path(__file__).resolve().parents[1]  # where failing_workload.py lies
FAILING = "failing_workload:build"
# small beside the machine, above what a worker tracing a tiny preset holds (up to 1.45 GiB on an Intel Xeon)
CAP_MIB = 3000


def failing_env(**more: str) -> dict[str, str]:
    """The server's environment: failing_workload importable and allowed, a small memory cap, no job worker."""
    path = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
    return {"ADVISOR_WORKLOAD_MODULES": "failing_workload", "PYTHONPATH": path,
            "ADVISOR_ESTIMATE_MEMORY_CAP": f"{CAP_MIB}MB", "ADVISOR_RUN_JOBS": "false", **more}


def estimate_body(mode: str | None = None, workload: str = "tiny-mlp", hardware: str = "h100-sxm") -> dict:
    if mode is not None:
        return {"workload": FAILING, "workload_args": {"mode": mode}, "hardware": hardware}
    return {"workload": workload, "hardware": hardware}


def children(pid: int) -> dict[int, str]:
    """The live children of `pid`: pid -> command line."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                out[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue  # exited meanwhile
    return out


def isolation_processes(http_worker: int) -> tuple[list[int], list[int], list[int]]:
    """(fork servers, their workers, anything else) under one HTTP worker process."""
    servers, others = [], []
    for pid, cmd in children(http_worker).items():
        (servers if "advisor.isolation.forkserver" in cmd else others).append(pid)
    workers = [w for s in servers for w in children(s)]
    return servers, workers, others


def test_failing_workloads_answer_422_while_the_server_answers_others(sqlite_url, serve, request):
    server = serve(sqlite_url, **failing_env(ADVISOR_API_ESTIMATE_TIMEOUT_S="8", ADVISOR_API_WORKERS="2",
                                             ADVISOR_API_QUEUE="0"))
    c = server.client()
    request.addfinalizer(c.close)
    warm = c.post("/v1/estimate", json=estimate_body(), timeout=120)  # waits for the fork server's imports
    assert warm.status_code == 200, warm.text
    with ThreadPoolExecutor(2) as threads, httpx.Client(base_url=server.base, timeout=120) as other:
        hang = threads.submit(other.post, "/v1/estimate", json=estimate_body("hang"))
        time.sleep(1.0)
        # one worker hangs: health and an estimate of a preset are answered meanwhile
        assert c.get("/healthz").status_code == 200
        tiny = c.post("/v1/estimate", json=estimate_body(hardware="l4"))
        assert tiny.status_code == 200 and tiny.json()["workload"] == "tiny-mlp", tiny.text
        assert not hang.done()
        # both workers hang and no request may wait: 503 with Retry-After, at once
        second = threads.submit(httpx.post, f"{server.base}/v1/estimate", json=estimate_body("hang"), timeout=120)
        time.sleep(1.0)
        assert not hang.done()
        t0 = time.monotonic()
        full = c.post("/v1/estimate", json=estimate_body(hardware="cpu"))
        assert full.status_code == 503 and "busy" in full.json()["detail"], full.text
        assert int(full.headers["retry-after"]) >= 1 and time.monotonic() - t0 < 2
        # a request the pool could never serve is refused as such, not as busy
        for path, body in (("/v1/estimate", estimate_body(hardware="h900-sxm")),
                           ("/v1/estimate/curve", estimate_body(hardware="h900-sxm")),
                           ("/v1/recommend", {"workload": "tiny-mlp", "hardware": ["l4", "h900-sxm"]})):
            bad = c.post(path, json=body)
            assert bad.status_code == 422 and "unknown hardware 'h900-sxm'" in bad.json()["detail"], (path, bad.text)
        for answer in (hang.result(), second.result()):
            assert answer.status_code == 422, answer.text
            assert "did not finish within 8 s" in answer.json()["detail"]
            assert "loss" in answer.json()["detail"] and "killed" in answer.json()["detail"]

    # what fails at once; the hog, which writes gigabytes before its cap stops it, is the next test's
    reasons = {"abort": ["loss crashed (SIGABRT)"], "exit": ["loss exited (SystemExit: 3)"]}
    for mode, says in reasons.items():
        r = c.post("/v1/estimate", json=estimate_body(mode))
        assert r.status_code == 422, (mode, r.text)
        assert all(s in r.json()["detail"] for s in says), (mode, r.json())
        assert "\n" not in r.json()["detail"] and "Traceback" not in r.text
    # the server is the same process, and holds no worker beyond the pool's idle ones
    assert server.proc.poll() is None
    assert c.get("/healthz").status_code == 200
    assert c.post("/v1/estimate", json=estimate_body()).status_code == 200
    servers, workers, others = isolation_processes(server.proc.pid)
    assert len(servers) == 1 and others == [] and len(workers) <= 2, (servers, workers, others)


def test_a_workload_that_raises_or_outgrows_the_cap_answers_422(sqlite_url, serve):
    # a loss that raises while traced on fake tensors sends the estimator to real steps at batch 1 and 2
    # (fresh processes, seconds each): a time limit that lets them end with the loss's own error
    server = serve(sqlite_url, **failing_env(ADVISOR_API_ESTIMATE_TIMEOUT_S="120"))
    with server.client() as c:
        r = c.post("/v1/estimate", json=estimate_body("raise"), timeout=180)
        assert r.status_code == 422, r.text
        assert "RuntimeError" in r.json()["detail"] and "the loss failed on purpose" in r.json()["detail"]
        hog = c.post("/v1/estimate", json=estimate_body("hog"), timeout=180)
        assert hog.status_code == 422, hog.text
        cap = f"past the memory cap of {CAP_MIB * 10**6 / 2**20:,.0f} MiB"
        assert "model reached" in hog.json()["detail"] and cap in hog.json()["detail"], hog.text
        assert "\n" not in hog.json()["detail"] and "Traceback" not in hog.text
        rec = c.post("/v1/recommend", json={"workload": FAILING, "workload_args": {"mode": "abort"},
                                            "hardware": ["cpu", "l4"]}, timeout=180)
        assert rec.status_code == 422 and "crashed (SIGABRT)" in rec.json()["detail"], rec.text
        # a preset's own arguments can ask for more memory than the cap: a 422, not a dead server
        huge = c.post("/v1/recommend", json={"workload": "tiny-gpt2", "workload_args": {"seq_len": 10**8},
                                             "hardware": ["cpu", "l4"]}, timeout=180)
        assert huge.status_code == 422 and "past the memory cap" in huge.json()["detail"], huge.text
        assert c.get("/healthz").status_code == 200 and server.proc.poll() is None


def test_concurrent_cold_requests_never_take_an_http_worker_down(sqlite_url, serve):
    server = serve(sqlite_url, "--http-workers", "2", "--no-jobs", **failing_env(ADVISOR_API_ESTIMATE_TIMEOUT_S="60"))
    http_workers = sorted(p for p, cmd in children(server.proc.pid).items() if "spawn_main" in cmd)
    assert len(http_workers) == 2, children(server.proc.pid)
    hardware = ["cpu", "h100-sxm", "l4"]
    requests = []
    for i in range(32):
        workload = ["tiny-gpt2", "tiny-mlp", FAILING][i % 3]
        args = {"mode": "abort"} if workload == FAILING else {}
        if i % 2:
            requests.append(("/v1/estimate", {"workload": workload, "workload_args": args,
                                              "hardware": hardware[i // 2 % 3], "batch_size": 1 + i}))
        else:
            requests.append(("/v1/recommend", {"workload": workload, "workload_args": args,
                                               "hardware": hardware[: 1 + i // 2 % 3]}))

    def send(req: tuple[str, dict]) -> tuple[str, dict, httpx.Response]:
        with httpx.Client(base_url=server.base, timeout=180) as fresh:  # a connection each: both workers take some
            return req[0], req[1], fresh.post(req[0], json=req[1])

    with ThreadPoolExecutor(32) as threads:
        answers = list(threads.map(send, requests))
    seen = {}
    for path, body, r in answers:
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code in (200, 422, 503), (path, body, r.status_code, r.text)
        if r.status_code == 503:
            assert int(r.headers["retry-after"]) >= 1 and r.json()["detail"], r.text
        if r.status_code == 422:  # the crash, or a call that the load on two cores pushed past its time limit
            crashed = body["workload"] == FAILING and "crashed (SIGABRT)" in r.json()["detail"]
            assert crashed or "did not finish within 60 s" in r.json()["detail"], (body, r.text)
        if body["workload"] == FAILING:
            assert r.status_code != 200, r.text
    assert seen.get(200, 0) >= 4, seen
    after = sorted(p for p, cmd in children(server.proc.pid).items() if "spawn_main" in cmd)
    assert after == http_workers and server.proc.poll() is None
    assert httpx.get(f"{server.base}/healthz", timeout=30).status_code == 200


@pytest.mark.parametrize("args,says", [
    ({f"k{i}": i for i in range(33)}, "workload_args: at most 32 entries"),
    ({"seq_len": "x" * 10_000}, "at most 256"),
    ({"k" * 65: 1}, "at most 64 characters"),
    ({"seq-len": 1}, "not an identifier"),
    ({"seq_len": [1, 2]}, "give a string, number, boolean or null"),
    ({"seq_len": {"a": 1}}, "give a string, number, boolean or null"),
    ({"seq_len": 2**70}, "64-bit"),
])
def test_workload_args_are_bounded(sqlite_url, make_client, args, says):
    c = make_client(sqlite_url)
    for path, hardware in (("/v1/estimate", "h100-sxm"), ("/v1/recommend", ["l4"])):
        r = c.post(path, json={"workload": "tiny-gpt2", "workload_args": args, "hardware": hardware})
        assert r.status_code == 422 and says in r.json()["detail"], r.text
        assert len(r.text) < 400  # the message does not echo the input back


def test_non_finite_workload_args_are_refused(sqlite_url, make_client):
    c = make_client(sqlite_url)
    for number in ("NaN", "Infinity", "-Infinity", "1e999"):
        body = '{"workload": "tiny-gpt2", "workload_args": {"seq_len": %s}, "hardware": "l4"}' % number
        r = c.post("/v1/estimate", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 422 and "'seq_len' is not a finite number" in r.json()["detail"], (number, r.text)
    fine = {"seq_len": 64, "vocab": 512}
    ok = c.post("/v1/estimate", content=json.dumps({"workload": "tiny-gpt2", "workload_args": fine,
                                                    "hardware": "l4"}), headers={"content-type": "application/json"})
    assert ok.status_code == 200, ok.text


def test_openapi_documents_the_workload_failures_and_503(sqlite_url, make_client):
    paths = make_client(sqlite_url).get("/openapi.json").json()["paths"]
    for path in ("/v1/estimate", "/v1/recommend", "/v1/tune"):
        responses = paths[path]["post"]["responses"]
        assert "Retry-After" in responses["503"]["headers"] and "isolated worker" in responses["422"]["description"]
        assert responses["503"]["content"]["application/json"]["schema"]["$ref"].endswith("ErrorBody")
