"""GET /metrics: Prometheus text. Request counts and latencies by route template (not by raw path,
so a scanner cannot blow up the label set), and jobs and trials by status, read from the store
when scraped."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from starlette.types import ASGIApp, Message, Receive, Scope, Send

if TYPE_CHECKING:
    from advisor.store.sql import SqlResultStore

log = logging.getLogger(__name__)
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    """One registry per app, so two apps in one process (tests) count apart."""

    def __init__(self, store: Callable[[], "SqlResultStore"]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("advisor_http_requests", "HTTP requests answered", ["method", "route", "status"],
                                registry=self.registry)
        self.latency = Histogram("advisor_http_request_duration_seconds", "Time to answer (s)", ["method", "route"],
                                 buckets=BUCKETS, registry=self.registry)
        self.registry.register(_StoreCollector(store))


class _StoreCollector:
    """advisor_jobs{status} and advisor_trials{status}, counted in the store at scrape time."""

    def __init__(self, store: Callable[[], "SqlResultStore"]) -> None:
        self.store = store

    def describe(self) -> list:
        return []  # no samples at registration: the store may not be reachable yet

    def collect(self) -> Iterator[GaugeMetricFamily]:
        from advisor.store.jobs import JobQueue
        from advisor.store.records import JOB_STATUSES, TRIAL_STATUSES

        try:
            store = self.store()
            jobs = JobQueue(store).counts()
            trials = store.trial_status_counts()
        except Exception as exc:  # a scrape must not fail because the database is down; `up` says so
            log.warning("metrics: store unreachable: %s", exc)
            up = GaugeMetricFamily("advisor_store_up", "1 if the store answered this scrape")
            up.add_metric([], 0)
            yield up
            return
        up = GaugeMetricFamily("advisor_store_up", "1 if the store answered this scrape")
        up.add_metric([], 1)
        yield up
        for name, doc, counts, statuses in (("advisor_jobs", "Tune jobs by status", jobs, JOB_STATUSES),
                                            ("advisor_trials", "Stored trials by status", trials, TRIAL_STATUSES)):
            family = GaugeMetricFamily(name, doc, labels=["status"])
            for status in statuses:
                family.add_metric([status], counts.get(status, 0))
            yield family


class MetricsMiddleware:
    """Counts and times every HTTP request under its route's template (`/v1/jobs/{job_id}`)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        code = {"status": 500}

        async def recording_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                code["status"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            method = scope.get("method", "")
            self.metrics.requests.labels(method, template, str(code["status"])).inc()
            self.metrics.latency.labels(method, template).observe(time.perf_counter() - t0)
