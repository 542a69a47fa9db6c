#!/usr/bin/env python
"""Load benchmark of the HTTP API (issue 5, item 8): POST /v1/recommend answered from stored results
to 200 concurrent clients over loopback, against `advisor serve` running as its own process.

    .venv/bin/python bench/api_load.py [--duration 20] [--warmup 5] [--clients 200] [--http-workers 1,2]
        [--drivers wrk,httpx,raw] [--open-interval-ms 100,250] [--think-ms 100] [--no-recheck-diagnostic]
        [--py-spy PATH]

A fresh SQLite store in a temp data dir gets real trials of tiny-gpt2 and tiny-mlp measured on this
CPU (probes.run_trial), written as studies the way the tuner writes them, plus stored bests of
tiny-gpt2 on two catalog GPUs (stored figures, not measured here: this machine has no GPU). Then for
each --http-workers setting the server starts (`advisor serve --no-jobs`), every request body is
warmed (the first recommend for a body builds the workload's model), and the drivers run, each for
--warmup s (not counted) and then --duration s:

- closed loop (wrk, httpx, raw): 200 connections, each sending its next request as soon as the last
  response is read, no think time. wrk cycles the bodies with bench/api_load.lua; httpx and raw are
  200 asyncio clients in one process, one keep-alive connection each (raw: a minimal HTTP/1.1 client,
  about a tenth of httpx's CPU per request).
- open loop (raw, --open-interval-ms): each client sends one request every N ms on a fixed schedule
  (wrk2-like); latency counts from the scheduled send, so a stalled server is not hidden.
- think time (wrk, --think-ms): each connection waits N ms after each response.

The load generator shares this machine's cores with the server; the CPU each used is reported, with
the rest of the machine's. Goal: p99 <= 50 ms and no errors (non-2xx, socket errors, timeouts).
Writes bench/results/api_load.json and api_load.md (BENCHMARKS.md's section: bench/compose_benchmarks.py).
The server is stopped and the temp dir removed at the end, also on failure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
LUA = ROOT / "bench" / "api_load.lua"
SECTION = "## HTTP API under load (issue 5, item 8)"
GOAL_P99_MS = 50.0
DIAGNOSTIC = ", store re-check off (diagnostic)"
TICK = os.sysconf("SC_CLK_TCK")

GPT = ("tiny-gpt2", {"num_samples": 4096})  # a dataset large enough that no batch is capped by it
MLP = ("tiny-mlp", {})
MEASURED = [(*GPT, [{"batch_size": b, "precision": p} for p in ("fp32", "bf16") for b in (4, 16)]),
            (*MLP, [{"batch_size": b, "precision": p} for p in ("fp32", "bf16") for b in (8, 64)])]
# Stored figures for catalog GPUs (samples/s, peak bytes): not measured on this machine.
STORED_GPU = {"h100-sxm": (2048, 95_000.0, 6 << 30), "a100-80gb": (2048, 52_000.0, 6 << 30)}
PRICES = {"cpu": 0.05, "h100-sxm": 3.2, "l4": 0.7, "a100-80gb": 1.8}


def bodies() -> list[dict[str, Any]]:
    """The request mix: distinct bodies, so distinct cache keys (and models built at warm-up)."""
    (g, gargs), (m, _) = GPT, MLP
    three = ["cpu", "h100-sxm", "l4"]
    return [{"workload": g, "workload_args": gargs, "hardware": three, "prices": {k: PRICES[k] for k in three}},
            {"workload": g, "workload_args": gargs, "hardware": three},
            {"workload": g, "workload_args": gargs, "hardware": ["cpu", "a100-80gb", "h100-sxm", "l4"],
             "prices": {"a100-80gb": 1.8, "h100-sxm": 3.2}},
            {"workload": m, "hardware": three, "prices": {k: PRICES[k] for k in three}},
            {"workload": m, "hardware": "cpu"},
            {"workload": m, "hardware": ["h100-sxm", "a100-80gb"]}]


# -- the store ---------------------------------------------------------------------------------------
def build_store(url: str) -> dict[str, Any]:
    """Measure MEASURED on this CPU and store each set as a study; store STORED_GPU as tiny-gpt2 bests."""
    from advisor.trial import TrainingConfig, TrialBudget
    from probes.runner import run_trial

    budget = TrialBudget(warmup_steps=2, min_steps=5, min_time_s=0.5, timeout_s=180, settle_s=0)
    facts: dict[str, Any] = {"measured": [], "stored_gpu": []}
    for workload, args, configs in MEASURED:
        results = [run_trial(workload, dict(c, device="cpu"), hardware="cpu", workload_args=args, budget=budget,
                             estimate=False) for c in configs]
        bad = [r.error for r in results if not (r.ok and r.samples_per_s)]
        if bad:
            raise SystemExit(f"a {workload} trial failed on this CPU: {bad[0]}")
        _write_study(url, workload, args, "cpu", results)
        facts["measured"] += [{"workload": workload, "hardware": "cpu", "config": r.config.changes() |
                               {"batch_size": r.config.batch_size}, "samples_per_s": r.samples_per_s} for r in results]
    for hw, (batch, sps, peak) in STORED_GPU.items():
        config = TrainingConfig(device="cuda", batch_size=batch, precision="bf16", num_workers=2)
        _write_study(url, GPT[0], GPT[1], hw, [_stored_result(config, hw, sps, peak)])
        facts["stored_gpu"].append({"workload": GPT[0], "hardware": hw, "batch_size": batch, "samples_per_s": sps,
                                    "note": "stored figure, not measured here"})
    return facts


def _write_study(url: str, workload: str, args: dict, hardware: str, results: list) -> None:
    """One study as the tuner writes it: claim, finish, update the pair's best (samples/s, maximize)."""
    from advisor.fingerprint import workload_fingerprint
    from advisor.hardware import get_hardware
    from advisor.store import Objective, StudySpec, hardware_fingerprint, open_store, software_versions
    from advisor.trial import TrainingConfig
    from advisor.workload import load_workload

    objective = Objective.parse("samples_per_s:maximize")
    wl, hw = load_workload(workload, args), get_hardware(hardware)
    spec = StudySpec(name=f"bench-{workload}-{hardware}", workload_fp=workload_fingerprint(wl), workload_name=wl.name,
                     workload_description={"spec": workload, "args": args}, hardware_fp=hardware_fingerprint(hw),
                     hardware_name=hw.accelerator.name, hardware_spec=hw.model_dump(mode="json"), objective=objective,
                     software=software_versions())
    with open_store(url) as store:
        study = store.create_or_get_study(spec)
        for result in results:
            config = TrainingConfig.model_validate(result.config.model_dump())
            rec = store.finish_trial(store.claim_trial(study.id, config), result)
            store.update_best(study.workload_fp, study.hardware_fp, objective, rec.id)
        store.finish_study(study.id)


def _stored_result(config, hardware: str, samples_per_s: float, peak: int):  # noqa: ANN001, ANN202
    from advisor.trial import PeakMemory, StepTimes, TrialResult, TrialStatus

    step = config.batch_size / samples_per_s  # s per optimizer step
    return TrialResult(status=TrialStatus.ok, workload=GPT[0], hardware=hardware, config=config,
                       samples_per_s=samples_per_s, tokens_per_s=samples_per_s * 32,
                       step_time_s=StepTimes(p50=step, p90=1.1 * step, mean=1.05 * step), data_wait_fraction=0.01,
                       peak_memory_bytes=peak, peak_memory=PeakMemory(cuda_reserved_bytes=peak),
                       predicts="cuda_reserved", measured_steps=20, wall_s=30.0, measured_s=5.0, warmup_s=2.0)


# -- the server --------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving(url: str, data_dir: Path, workers: int, env: dict[str, str]) -> Iterator[dict[str, Any]]:
    """`advisor serve` in its own session (a stop reaches only it); stopped on the way out, always."""
    port = free_port()
    cmd = [sys.executable, "-m", "advisor.cli", "serve", "--db", url, "--port", str(port), "--no-jobs",
           "--http-workers", str(workers)]
    env = {**os.environ, "ADVISOR_DATA_DIR": str(data_dir), "ADVISOR_LOG_LEVEL": "WARNING", **env}
    log = open(data_dir / f"serve-{port}.log", "wb")
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_healthy(base, proc, data_dir / f"serve-{port}.log")
        yield {"base": base, "pid": proc.pid, "port": port, "cmd": cmd}
    finally:
        _stop(proc)
        log.close()


def _wait_healthy(base: str, proc: subprocess.Popen, log: Path, timeout: float = 120) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"advisor serve exited ({proc.returncode}): {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{base}/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"advisor serve did not answer /healthz in {timeout:.0f} s: {log.read_text()[-2000:]}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)  # the process group started above: the server and its workers
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def tree_cpu_s(root: int) -> float:
    """User + system CPU seconds of `root` and its live descendants (from /proc)."""
    parent: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue  # exited meanwhile
            parent[int(d.name)], ticks[int(d.name)] = int(fields[1]), int(fields[11]) + int(fields[12])
    tree, grew = {root}, True
    while grew:
        more = {p for p, pp in parent.items() if pp in tree} - tree
        tree |= more
        grew = bool(more)
    return sum(ticks.get(p, 0) for p in tree) / TICK


def settle(pid: int, idle_share: float = 0.05, timeout: float = 60.0) -> float:
    """Wait until the server's processes use under `idle_share` of a core over 0.5 s (a run that
    overloaded it may leave work queued), at most `timeout` s; returns the seconds waited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        before = tree_cpu_s(pid)
        time.sleep(0.5)
        if tree_cpu_s(pid) - before < idle_share * 0.5:
            break
    return time.monotonic() - t0


def machine_busy_s() -> float:
    """CPU seconds all cores spent busy (not idle, not iowait) since boot."""
    v = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(v[:8]) - v[3] - v[4]) / TICK


def connections_by_pid(port: int) -> dict[str, int]:
    """Established connections to `port`, counted by the server process holding them (`ss -tnp`)."""
    out = subprocess.run(["ss", "-tnpH", "state", "established", f"( sport = :{port} )"], capture_output=True,
                         text=True).stdout
    counts: dict[str, int] = {}
    for line in out.splitlines():
        pid = line.split("pid=", 1)[1].split(",", 1)[0] if "pid=" in line else "?"
        counts[pid] = counts.get(pid, 0) + 1
    return counts


# -- warm-up -----------------------------------------------------------------------------------------
def warm(base: str, payloads: list[bytes], parallel: int = 8, fast_s: float = 0.5) -> list[dict[str, Any]]:
    """Each body once (its first answer builds the workload's model in an isolated worker), then in rounds
    of `parallel` requests at once, each on a new connection, until a round answers within `fast_s`: with
    several HTTP workers every process must have computed and cached it. A 503 (the process's isolated
    workers busy, its queue full) is tried again after its Retry-After; any other non-200 stops the run:
    the mix must be valid."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    def post(payload: bytes) -> float:
        t0 = time.perf_counter()
        for _ in range(60):
            r = httpx.post(f"{base}/v1/recommend", content=payload, headers={"content-type": "application/json"},
                           timeout=300, verify=False)  # plain HTTP; verify=False spares loading the CA bundle
            if r.status_code != 503:
                break
            time.sleep(float(r.headers.get("retry-after", 1)))
        if r.status_code != 200:
            raise SystemExit(f"warm-up: {r.status_code} {r.text[:300]} for {payload.decode()}")
        return time.perf_counter() - t0

    out = []
    with ThreadPoolExecutor(parallel) as pool:
        for payload in payloads:
            first, rounds = post(payload), []
            while len(rounds) < 20 and (not rounds or max(rounds[-1]) > fast_s):
                rounds.append(list(pool.map(post, [payload] * parallel)))
            out.append({"first_s": first, "rounds": len(rounds), "last_round_max_ms": max(rounds[-1]) * 1e3})
    return out


# -- drivers -----------------------------------------------------------------------------------------
def run_wrk(base: str, bodies_file: Path, seconds: float, clients: int, threads: int,
            think_ms: float | None = None) -> dict[str, Any]:
    """wrk; its Lua done() prints the summary as JSON (latencies in microseconds). wrk 4 corrects its
    latency histogram for coordinated omission before reporting (stats_correct: a sample longer than
    runtime / requests-per-connection adds synthetic samples at that interval), so one stalled
    connection weighs as much as the requests it would have sent."""
    cmd = ["wrk", f"-t{threads}", f"-c{clients}", f"-d{seconds:g}s", "--timeout", "10s", "--latency", "-s", str(LUA),
           base, "--", str(bodies_file), *([f"{think_ms:g}"] if think_ms else [])]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 120)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("WRK_JSON ")), None)
    if out.returncode != 0 or line is None:
        raise SystemExit(f"wrk failed ({out.returncode}): {out.stderr[-1000:]} {out.stdout[-1000:]}")
    raw = json.loads(line.split(" ", 1)[1])
    lat = {k: raw["latency_us"][k] / 1e3 for k in ("p50", "p90", "p99", "max")}
    errors = {k: v for k, v in raw["errors"].items() if v}
    return {"command": " ".join(cmd), "requests": raw["requests"], "errors": errors,
            "seconds": raw["duration_us"] / 1e6, "latency_ms": lat,
            "note": "latencies as wrk reports them (corrected for coordinated omission); status error: >= 400; "
                    "a request past --timeout is a timeout error, left out of the latencies"}


def run_python(client: str, base: str, payloads: list[bytes], seconds: float, warmup: float, clients: int,
               interval_ms: float | None) -> dict[str, Any]:
    """The asyncio driver below, in a fresh process (no torch in its heap, so no long GC pauses)."""
    params = {"client": client, "base": base, "payloads": [p.decode() for p in payloads], "seconds": seconds,
              "warmup": warmup, "clients": clients, "interval_s": interval_ms / 1e3 if interval_ms else None}
    cmd = [sys.executable, str(Path(__file__).resolve()), "_drive", json.dumps(params)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + warmup + 180)
    if out.returncode != 0:
        raise SystemExit(f"{client} driver failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout)


def _drive(params: dict[str, Any]) -> dict[str, Any]:
    try:
        import uvloop

        loop_name, runner = f"uvloop {uvloop.__version__}", uvloop.run
    except ImportError:
        loop_name, runner = "asyncio", asyncio.run
    res = runner(_drive_async(**params))
    res["client_loop"] = loop_name
    return res


class HttpxClient:
    """One httpx.AsyncClient with one keep-alive connection."""

    def __init__(self, base: str, bodies: list[bytes]) -> None:
        import httpx

        self.bodies, self.errors = bodies, (httpx.HTTPError,)
        # verify=False: plain HTTP over loopback; it spares each client loading the CA bundle (~30 ms CPU)
        self.client = httpx.AsyncClient(base_url=base, timeout=10.0, limits=httpx.Limits(max_connections=1),
                                        verify=False)

    async def post(self, k: int) -> int:
        r = await self.client.post("/v1/recommend", content=self.bodies[k],
                                   headers={"content-type": "application/json"})
        return r.status_code

    async def close(self) -> None:
        await self.client.aclose()


class RawClient:
    """A minimal HTTP/1.1 keep-alive client on asyncio streams: pre-built requests, reads the status
    line, Content-Length and body. About a tenth of httpx's CPU per request, so the driver leaves
    more of the shared cores to the server and can keep an open-loop schedule."""

    def __init__(self, base: str, bodies: list[bytes]) -> None:
        self.host, port = base.removeprefix("http://").split(":")
        self.port = int(port)
        head = f"POST /v1/recommend HTTP/1.1\r\nHost: {self.host}:{port}\r\nContent-Type: application/json\r\n"
        self.requests = [f"{head}Content-Length: {len(b)}\r\n\r\n".encode() + b for b in bodies]
        self.errors = (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ValueError)
        self.reader = self.writer = None

    async def post(self, k: int) -> int:
        try:
            async with asyncio.timeout(10):
                if self.writer is None:
                    self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
                self.writer.write(self.requests[k])
                head = await self.reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
                await self.reader.readexactly(length)
                return int(head[9:12])
        except BaseException:
            await self.close()  # the connection's state is unknown: the next request opens a new one
            raise

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.reader = self.writer = None


async def _drive_async(client: str, base: str, payloads: list[str], seconds: float, warmup: float, clients: int,
                       interval_s: float | None) -> dict[str, Any]:
    """`clients` clients, one keep-alive connection each, connected during the warm-up. Closed loop
    (interval_s None): the next request goes when the response is read. Open loop: client i sends at
    start + (i / clients + k) x interval; latency counts from that scheduled time (wrk2's correction)."""
    bodies = [p.encode() for p in payloads]
    pool = [(HttpxClient if client == "httpx" else RawClient)(base, bodies) for _ in range(clients)]
    start = time.perf_counter() + 0.2
    record_from, end = start + warmup, start + warmup + seconds
    latencies: list[float] = []
    lags: list[float] = []  # open loop: actual send - scheduled send (s): the driver keeping up, or not
    errors: dict[str, int] = {}

    async def one(i: int, c: HttpxClient | RawClient) -> None:
        k, due = i, start + (interval_s or 0) * i / clients
        while True:
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            t_send = time.perf_counter()
            t0 = due if interval_s else t_send
            if t0 >= end:
                return
            due += interval_s or 0
            try:
                code = await c.post(k % len(bodies))
                status = None if code < 300 else str(code)
            except c.errors as exc:
                status = type(exc).__name__
            k += 1
            if t0 >= record_from:
                latencies.append(time.perf_counter() - t0)
                lags.append(t_send - t0)
                if status:
                    errors[status] = errors.get(status, 0) + 1

    await asyncio.gather(*(one(i, c) for i, c in enumerate(pool)))
    finished = time.perf_counter()
    for c in pool:
        await c.close()
    # open loop: a driver behind schedule finishes late; its rate is over the whole time it took
    took = seconds + max(0.0, finished - end) if interval_s else seconds
    return {"requests": len(latencies), "errors": errors, "seconds": took, "drain_s": finished - end,
            "latency_ms": percentiles_ms(latencies), "send_lag_ms": percentiles_ms(lags) if interval_s else None,
            "offered_per_s": clients / interval_s if interval_s else None,
            "note": "every request's own latency, uncorrected in closed loop; errors: status >= 300 by code, "
                    "exceptions by class"}


def percentiles_ms(seconds: list[float]) -> dict[str, float]:
    s = sorted(seconds)
    if not s:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan"), "max": float("nan")}
    rank = lambda q: s[min(len(s) - 1, max(0, int(round(q * len(s))) - 1))]  # noqa: E731 (nearest rank)
    return {"p50": rank(0.50) * 1e3, "p90": rank(0.90) * 1e3, "p99": rank(0.99) * 1e3, "max": s[-1] * 1e3}


# -- one measured run --------------------------------------------------------------------------------
def measured(server: dict[str, Any], run, window_start_s: float, seconds: float) -> dict[str, Any]:  # noqa: ANN001
    """`run()` with the CPU it cost: server process tree, the driver (a child, reaped by then), the
    rest of the machine; and the server's connections by process ("?": not accepted yet), sampled 1 s
    into the measured window and halfway through it."""
    import threading

    conns: dict[str, dict[str, int]] = {}
    timers = [threading.Timer(window_start_s + at, lambda k=k: conns.__setitem__(k, connections_by_pid(server["port"])))
              for k, at in (("at_1s", 1.0), ("halfway", seconds / 2))]
    load0, busy0, srv0 = os.getloadavg(), machine_busy_s(), tree_cpu_s(server["pid"])
    kids0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    for t in timers:
        t.start()
    try:
        res = run()
    finally:
        for t in timers:
            t.cancel()
    kids1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    srv = tree_cpu_s(server["pid"]) - srv0
    driver = (kids1.ru_utime + kids1.ru_stime) - (kids0.ru_utime + kids0.ru_stime)
    busy = machine_busy_s() - busy0
    res["rps"] = res["requests"] / res["seconds"] if res["seconds"] else 0.0
    res["error_total"] = sum(res["errors"].values())
    res["cpu_s"] = {"server": srv, "driver": driver, "others": max(0.0, busy - srv - driver), "machine_busy": busy}
    res["server_cpu_ms_per_request"] = srv / res["requests"] * 1e3 if res["requests"] else None
    res["connections_by_server_pid"] = conns
    res["loadavg_before"], res["loadavg_after"] = load0[0], os.getloadavg()[0]
    return res


def bench_setting(url: str, data_dir: Path, workers: int, env: dict[str, str],
                  args: argparse.Namespace) -> dict[str, Any]:
    """Start the server with `workers` HTTP workers (and `env`), warm every body, run each driver; stop it."""
    payloads = [json.dumps(b, separators=(",", ":")).encode() for b in bodies()]
    bodies_file = data_dir / "bodies.jsonl"
    bodies_file.write_bytes(b"\n".join(payloads) + b"\n")
    runs = []
    with serving(url, data_dir, workers, env) as server:
        warmed = warm(server["base"], payloads)
        firsts = ", ".join(f"{w['first_s']:.2f}" for w in warmed)
        print(f"  {workers} worker(s): warmed {len(payloads)} bodies; first answers {firsts} s", flush=True)
        for driver, loop, param in _plan(args):
            base, tag = server["base"], f"{driver}-{loop}{param or ''}" + ("-norecheck" if env else "")
            settled_s = settle(server["pid"])
            if driver == "wrk":
                run_wrk(base, bodies_file, args.warmup, args.clients, args.wrk_threads, param)  # warm-up, discarded
                spy = _py_spy(args, server, tag, workers, args.duration)
                res = measured(server, partial(run_wrk, base, bodies_file, args.duration, args.clients,
                                               args.wrk_threads, param), 0.0, args.duration)
            else:
                spy = _py_spy(args, server, tag, workers, args.duration, delay=args.warmup)
                res = measured(server, partial(run_python, driver, base, payloads, args.duration, args.warmup,
                                               args.clients, param), args.warmup, args.duration)
            profile = _py_spy_done(spy)
            res.update(driver=driver, loop=_loop_label(loop, param), workers=workers, server_env=env,
                       clients=args.clients, settled_s=settled_s, profile=profile,
                       profile_breakdown=profile_breakdown(Path(profile)) if profile else None)
            runs.append(res)
            print("  " + row(res), flush=True)
    return {"workers": workers, "server_env": env, "warm_up": warmed, "runs": runs}


def _settings(args: argparse.Namespace) -> list[tuple[int, dict[str, str]]]:
    out: list[tuple[int, dict[str, str]]] = [(w, {}) for w in args.workers]
    if args.no_recheck_diagnostic:
        out.append((max(args.workers), {"ADVISOR_RECOMMEND_CACHE_S": "3600"}))
    return out


def _plan(args: argparse.Namespace) -> list[tuple[str, str, float | None]]:
    """(driver, loop, parameter): closed loops, then open loops (per-client interval, ms), then wrk
    with think time (ms)."""
    plan: list[tuple[str, str, float | None]] = [(d, "closed", None) for d in args.drivers]
    plan += [(d, "open", ms) for d in args.open_drivers for ms in args.open_interval_ms]
    plan += [("wrk", "think", ms) for ms in args.think_ms]
    return plan


def _loop_label(loop: str, param: float | None) -> str:
    if loop == "open":
        return f"open: 1 request / {param:g} ms / client"
    if loop == "think":
        return f"think time {param:g} ms"
    return "closed"


def _py_spy(args: argparse.Namespace, server: dict[str, Any], tag: str, workers: int, seconds: float,
            delay: float = 0.0) -> tuple[subprocess.Popen, Path] | None:
    """py-spy record (collapsed stacks) of the server's processes over the measured window, if asked."""
    if not args.py_spy:
        return None
    out = RESULTS / f"{args.name}-profile-w{workers}-{tag}.txt"
    cmd = [args.py_spy, "record", "--pid", str(server["pid"]), "--subprocesses", "--format", "raw", "--rate", "100",
           "--duration", str(int(seconds)), "--output", str(out), "--nonblocking"]
    if delay:
        cmd = ["sh", "-c", f"sleep {delay:g} && exec \"$@\"", "sh", *cmd]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), out


def _py_spy_done(spy: tuple[subprocess.Popen, Path] | None) -> str | None:
    if spy is None:
        return None
    proc, out = spy
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return str(out) if out.exists() else None


# -- profile ----------------------------------------------------------------------------------------
# Where the event loop's time goes, from py-spy's collapsed stacks: each sample goes to the category of
# the deepest frame that matches one (first match in this order at that frame), else to the rest.
CATEGORIES = [
    ("the route itself (api/routes.py recommend, api/cache.py)", ("recommend (api/routes.py", "(api/cache.py")),
    ("FastAPI request handling: body read, JSON parse, validation, dependency solving",
     ("solve_dependencies (", "request_body_to_args (", "Request.json (", "Request.body (")),
    ("route matching (FastAPI/Starlette routers)",
     ("_match (fastapi/routing", ".matches (fastapi", ".matches (starlette")),
    ("response write (uvicorn RequestResponseCycle.send: transport write)", ("RequestResponseCycle.send (",)),
    ("HTTP parsing (uvicorn httptools protocol)", ("HttpToolsProtocol.",)),
    ("FastAPI native telemetry check (OpenTelemetry providers, per request)",
     ("NativeTelemetry.", "_unconfigured (", "(trace/__init__", "(metrics/_internal")),
    ("Prometheus metrics (api/metrics.py labels, observe)", ("(prometheus_client/",)),
    ("other framework layers (middleware chain, ASGI plumbing)", ("(starlette/", "(fastapi/", "(uvicorn/", "(api/")),
]
REST = "event loop and I/O (uvloop, no Python frame below)"


def profile_breakdown(path: Path) -> dict[str, Any]:
    """Shares of the event-loop thread's samples by CATEGORIES; worker threads counted apart."""
    shares = dict.fromkeys([c for c, _ in CATEGORIES] + [REST], 0)
    loop_n = threads_n = 0
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        frames = stack.split(";")
        if any("WorkerThread.run (" in f for f in frames):
            threads_n += int(n)
            continue
        if not any("Runner.run (" in f for f in frames):
            continue
        loop_n += int(n)
        shares[_category(frames)] += int(n)
    total = loop_n or 1
    return {"event_loop_samples": loop_n, "threadpool_samples": threads_n,
            "shares": {k: v / total for k, v in shares.items()}}


def _category(frames: list[str]) -> str:
    """The deepest frame with a named category, among the frames the loop runs (below asyncio's
    Runner.run: above it every sample has uvicorn's own); else framework layers, else the loop."""
    below = frames[next(i for i, f in enumerate(frames) if "Runner.run (" in f) + 1:]
    for frame in reversed(below):
        for name, patterns in CATEGORIES[:-1]:
            if any(p in frame for p in patterns):
                return name
    return CATEGORIES[-1][0] if any(p in f for f in below for p in CATEGORIES[-1][1]) else REST


# -- report ------------------------------------------------------------------------------------------
HEAD = ("| server | driver | loop | requests | errors | req/s | p50 ms | p90 ms | p99 ms | max ms | goal | "
        "server CPU ms/req | CPU s: server / driver / others |")


def row(r: dict[str, Any]) -> str:
    lat, cpu = r["latency_ms"], r["cpu_s"]
    kinds = ", ".join(f"{k} {v}" for k, v in r["errors"].items())
    errs = str(r["error_total"]) + (f" ({kinds})" if kinds else "")
    per = f"{r['server_cpu_ms_per_request']:.2f}" if r["server_cpu_ms_per_request"] else "-"
    server = f"{r['workers']} HTTP worker{'s' if r['workers'] > 1 else ''}" + (DIAGNOSTIC if r["server_env"] else "")
    return (f"| {server} | {r['driver']} | {r['loop']} | "
            f"{r['requests']:,} | {errs} | {r['rps']:,.0f} | {lat['p50']:.1f} | {lat['p90']:.1f} | {lat['p99']:.1f} | "
            f"{lat['max']:.1f} | {'met' if goal_met(r) else 'NOT met'} | {per} | "
            f"{cpu['server']:.1f} / {cpu['driver']:.1f} / {cpu['others']:.1f} |")


def goal_met(r: dict[str, Any]) -> bool:
    return r["error_total"] == 0 and r["latency_ms"]["p99"] <= GOAL_P99_MS and r["requests"] > 0


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("uvicorn", "uvloop", "httptools", "fastapi", "starlette", "pydantic", "httpx", "SQLAlchemy"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    wrk = shutil.which("wrk")
    banner = subprocess.run([wrk, "-v"], capture_output=True, text=True).stdout.split() if wrk else []
    out["wrk"] = banner[1] if len(banner) > 1 else "absent"  # "wrk debian/4.1.0-3+b2 [epoll] Copyright ..."
    return out


def machine() -> dict[str, Any]:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    mem = int(Path("/proc/meminfo").read_text().split()[1]) / 2**20  # kB -> GiB
    return {"cpus": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)), "cpu_model": cpu,
            "memory_gib": round(mem, 1), "gpu": "none" if not shutil.which("nvidia-smi") else "see nvidia-smi",
            "date": subprocess.run(["date"], capture_output=True, text=True).stdout.strip()}


def markdown(report: dict[str, Any]) -> str:
    runs = [r for s in report["settings"] for r in s["runs"]]
    lines = [SECTION, "", "Command:", "", "```bash", report["command"], "```", "", *_md_setup(report), "",
             HEAD, "|" + "---|" * (HEAD.count("|") - 1), *[row(r) for r in runs], ""]
    met = [r for r in runs if goal_met(r)]
    lines.append(f"Goal (p99 <= {GOAL_P99_MS:g} ms, no errors): met in {len(met)} of {len(runs)} runs"
                 + (f": {'; '.join(_label(r) for r in met)}." if met else "."))
    lines += ["", *_md_notes(runs)]
    profiled = [r for r in runs if r.get("profile_breakdown") and r["loop"] == "closed"]
    if profiled:
        lines += ["", *_md_profile(profiled)]
    return "\n".join(lines) + "\n"


def _md_setup(report: dict[str, Any]) -> list[str]:
    m, v, facts, n = report["machine"], report["versions"], report["store"], report["clients"]
    firsts = [w["first_s"] for s in report["settings"] for w in s["warm_up"]]
    gpus = ", ".join(f"{g['hardware']} ({g['samples_per_s']:,.0f} samples/s at batch {g['batch_size']})"
                     for g in facts["stored_gpu"])
    return [
        f"Machine: {m['cpus']} vCPUs ({m['cpu_model']}), {m['memory_gib']} GiB, no GPU; Python {v['python']}, "
        f"uvicorn {v['uvicorn']} (uvloop {v['uvloop']}, httptools {v['httptools']}: uvicorn's `auto` picks both), "
        f"fastapi {v['fastapi']}, starlette {v['starlette']}, httpx {v['httpx']}, wrk {v['wrk']}. Date: {m['date']}.",
        "",
        f"Served: `POST /v1/recommend`, {len(report['bodies'])} distinct bodies cycled ({len(report['bodies'])} cache "
        f"keys; `bench/api_load.py` lists them), from a fresh SQLite store holding {len(facts['measured'])} trials of "
        f"{GPT[0]} {json.dumps(GPT[1])} and {MLP[0]} measured on this CPU in this run, and stored bests of {GPT[0]} "
        f"on {gpus}: **stored figures, not measured here** (no GPU). Each body was warmed first (its first answer "
        f"builds the workload's model: {min(firsts):.2f}-{max(firsts):.2f} s); the measured windows are answered "
        "from the API's in-memory cache, which re-reads the store's best-generation every 2 s "
        "(ADVISOR_RECOMMEND_CACHE_S, default).",
        "",
        f"\"{n} concurrent clients\", as driven here ({report['duration_s']:g} s measured after "
        f"{report['warmup_s']:g} s of the same load):",
        f"- **closed loop** (wrk, httpx, raw): {n} keep-alive connections, each sending its next request the moment "
        f"the previous response is read, no think time. By Little's law the mean latency is {n} / throughput, so "
        f"p99 <= {GOAL_P99_MS:g} ms needs more than {n / GOAL_P99_MS * 1e3:,.0f} req/s.",
        f"- **open loop** (raw): each of the {n} clients sends one request every N ms on a fixed schedule "
        f"({n} x 1000 / N req/s offered); latency counts from the scheduled send, so a server (or driver) that "
        "falls behind is charged for it (wrk2's correction).",
        f"- **think time** (wrk): each of the {n} connections waits N ms after each response (wrk's `delay()`).",
        "- Drivers: wrk (2 threads, `--timeout 10s`, `bench/api_load.lua`); httpx (asyncio + uvloop, one "
        "AsyncClient with one connection per client); raw (the same script with a minimal asyncio HTTP/1.1 client, "
        "about a tenth of httpx's CPU per request). The load generator runs on the same 2 cores as the server; the "
        "last column splits the CPU used over each run between the server's processes, the driver and everything "
        "else on the machine.",
    ]


def _md_notes(runs: list[dict[str, Any]]) -> list[str]:
    notes = ["Notes on reading the table:",
             "- wrk's percentiles are its own, corrected for coordinated omission before they are reported (wrk 4's "
             "`stats_correct`: a response slower than runtime / requests-per-connection adds synthetic samples at "
             "that interval), so a connection stalled for seconds weighs as many requests as it could have sent. "
             "httpx's and raw's closed-loop percentiles are each request's own latency, uncorrected."]
    storms = [r for r in runs if r["driver"] == "wrk" and r["loop"] == "closed"]
    if storms:
        waiting = ", ".join(f"{_waiting(r, 'at_1s')} at 1 s, {_waiting(r, 'halfway')} halfway ({_label(r)})"
                            for r in storms)
        notes.append("- wrk opens its connections when its measured run starts; the server accepts them while "
                     "busy, and uvloop (libuv >= 1.45) accepts one connection per event-loop turn, so the last ones "
                     f"wait in the listen queue. Connections not yet accepted: {waiting}. httpx and raw connect "
                     "during their warm-up.")
    multi = [r for r in runs if r["workers"] > 1 and len(_accepted(r)) > 1]
    if multi:
        split = "; ".join(" / ".join(str(v) for v in _accepted(r).values()) + f" ({_label(r)})" for r in multi[:3])
        notes.append(f"- Connections per HTTP worker process (kernel's choice; uvicorn shares one socket): {split}.")
    lagged = [r for r in runs if r.get("send_lag_ms") and r["send_lag_ms"]["p99"] > 10]
    if lagged:
        notes.append("- Open loop behind schedule (send lag p99 > 10 ms): " + "; ".join(
            f"{_label(r)}: {r['rps']:,.0f} of {r['offered_per_s']:,.0f} req/s offered, lag p99 "
            f"{r['send_lag_ms']['p99']:,.0f} ms" for r in lagged) + ": the clients' previous responses came late "
            "(one request in flight per client), so those latencies are mostly queueing.")
    return notes


def _waiting(r: dict[str, Any], when: str) -> int:
    return r["connections_by_server_pid"].get(when, {}).get("?", 0)


def _accepted(r: dict[str, Any]) -> dict[str, int]:
    return {k: v for k, v in r["connections_by_server_pid"].get("halfway", {}).items() if k != "?"}


def _md_profile(runs: list[dict[str, Any]]) -> list[str]:
    cats = list(runs[0]["profile_breakdown"]["shares"])
    head = "| event-loop time (py-spy, 100 Hz) | " + " | ".join(_label(r) for r in runs) + " |"
    lines = ["Where the server's event loop spends its time (share of py-spy samples of the event-loop thread, "
             "all HTTP worker processes; each sample goes to the deepest frame of a named category):", "",
             head, "|" + "---|" * (len(runs) + 1)]
    for c in cats:
        lines.append(f"| {c} | " + " | ".join(f"{r['profile_breakdown']['shares'][c]:.0%}" for r in runs) + " |")
    lines.append("| samples (event loop / thread pool) | " + " | ".join(
        f"{r['profile_breakdown']['event_loop_samples']} / {r['profile_breakdown']['threadpool_samples']}"
        for r in runs) + " |")
    return lines


def _label(r: dict[str, Any]) -> str:
    return f"{r['workers']} worker{'s' if r['workers'] > 1 else ''}{DIAGNOSTIC if r['server_env'] else ''}, " \
           f"{r['driver']}, {r['loop']}"


# -- main --------------------------------------------------------------------------------------------
def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=20.0, help="measured seconds per run (s)")
    p.add_argument("--warmup", type=float, default=5.0, help="load before each measured window, not counted (s)")
    p.add_argument("--clients", type=int, default=200, help="concurrent clients (connections)")
    p.add_argument("--http-workers", default="1,2", help="comma-separated `advisor serve --http-workers` settings")
    p.add_argument("--drivers", default="wrk,httpx,raw", help="closed-loop drivers, comma-separated: wrk, httpx, raw")
    p.add_argument("--open-drivers", default="raw", help="open-loop drivers, comma-separated: httpx, raw")
    p.add_argument("--open-interval-ms", default="100,250", help="per-client send intervals of the open-loop runs, "
                   "comma-separated (ms); empty: none")
    p.add_argument("--think-ms", default="100", help="wrk think times (delay after each response), comma-separated "
                   "(ms); empty: none")
    p.add_argument("--wrk-threads", type=int, default=2)
    p.add_argument("--no-recheck-diagnostic", action="store_true", help="also run the most workers with the "
                   "store re-check off (ADVISOR_RECOMMEND_CACHE_S=3600): what the periodic re-check costs")
    p.add_argument("--py-spy", default=None, metavar="PATH", help="py-spy binary: profile the server in each run")
    p.add_argument("--name", default="api_load", help="results file names: bench/results/NAME.json, NAME.md")
    args = p.parse_args(argv)
    split = lambda text: [x for x in text.split(",") if x]  # noqa: E731
    args.drivers, args.open_drivers = split(args.drivers), split(args.open_drivers)
    args.workers = [int(w) for w in split(args.http_workers)]
    args.open_interval_ms = [float(x) for x in split(args.open_interval_ms)]
    args.think_ms = [float(x) for x in split(args.think_ms)]
    if ("wrk" in args.drivers or args.think_ms) and not shutil.which("wrk"):
        raise SystemExit("wrk is not installed (Debian: apt-get install -y wrk); or give --drivers httpx,raw "
                         "--think-ms ''")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the finally blocks stop the server, remove the dir
    started = machine()
    RESULTS.mkdir(parents=True, exist_ok=True)
    data_dir = Path(tempfile.mkdtemp(prefix="advisor-api-load-"))
    os.environ["ADVISOR_DATA_DIR"] = str(data_dir)  # trials, caches and the store stay in the temp dir
    sys.path.insert(0, str(ROOT))
    try:
        url = f"sqlite:///{data_dir / 'advisor.db'}"
        print(f"measuring trials on this CPU into {url} ...", flush=True)
        facts = build_store(url)
        print(HEAD, flush=True)
        settings = [bench_setting(url, data_dir, w, env, args) for w, env in _settings(args)]
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
    report = {"command": " ".join([".venv/bin/python", "bench/api_load.py", *(argv or sys.argv[1:])]),
              "machine": started, "versions": versions(), "clients": args.clients, "duration_s": args.duration,
              "warmup_s": args.warmup, "wrk_threads": args.wrk_threads, "goal": {"p99_ms": GOAL_P99_MS, "errors": 0},
              "bodies": bodies(), "store": facts, "settings": settings}
    (RESULTS / f"{args.name}.json").write_text(json.dumps(report, indent=1, default=str))
    section = markdown(report)
    (RESULTS / f"{args.name}.md").write_text(section)
    print("\n" + section)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "_drive":  # an asyncio driver's own process (run_python)
        print(json.dumps(_drive(json.loads(sys.argv[2]))))
        sys.exit(0)
    sys.exit(main())
