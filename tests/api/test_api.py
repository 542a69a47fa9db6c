"""The HTTP API over real stores (SQLite and PostgreSQL) holding real measured trials: catalog,
results and studies with filters and paging, estimate and recommend (the library's answers, with
provenance), auth, the workload allowlist, size limits, errors without traces, metrics."""

from __future__ import annotations

import re

import pytest

from api_common import TOKEN


def test_health_catalog_and_openapi(seeded, make_client):
    url, _ = seeded
    c = make_client(url)
    assert c.get("/healthz").json() == {"status": "ok", "store": "ok"}
    hardware = {h["name"]: h["spec"] for h in c.get("/v1/hardware").json()}
    assert hardware["h100-sxm"]["memory_bytes"] > 70 << 30
    workloads = {w["name"]: w for w in c.get("/v1/workloads").json()}
    assert "seq_len" in workloads["tiny-gpt2"]["parameters"]
    schema = c.get("/openapi.json").json()
    paths = schema["paths"]
    for path, method in [("/v1/estimate", "post"), ("/v1/recommend", "post"), ("/v1/hardware", "get"),
                         ("/v1/workloads", "get"), ("/v1/results", "get"), ("/v1/studies", "get"),
                         ("/v1/studies/{study_id}", "get"), ("/v1/studies/{study_id}/trials", "get"),
                         ("/v1/tune", "post"), ("/v1/jobs/{job_id}", "get"), ("/v1/jobs/{job_id}", "delete"),
                         ("/healthz", "get"), ("/metrics", "get")]:
        assert method in paths[path], (path, method)
    # request bodies carry examples; errors are documented as {"detail": ...}
    assert schema["components"]["schemas"]["RecommendRequest"].get("examples")
    unauthorized = paths["/v1/tune"]["post"]["responses"]["401"]["content"]["application/json"]
    assert unauthorized["schema"]["$ref"].endswith("ErrorBody")


def test_studies_and_results_page_and_filter(seeded, make_client):
    url, facts = seeded
    c = make_client(url)
    studies = c.get("/v1/studies").json()
    assert studies["total"] == 1
    study = studies["items"][0]
    assert study["trial_counts"] == {"ok": len(facts["trial_ids"])}
    assert study["best"]["id"] == facts["best_trial_id"]
    assert study["workload_name"] == "tiny-mlp" and study["hardware_name"] == "cpu"
    detail = c.get(f"/v1/studies/{facts['study_id']}").json()
    assert detail["space"] is not None and detail["id"] == facts["study_id"]
    trials = c.get(f"/v1/studies/{facts['study_id']}/trials", params={"limit": 2, "offset": 1}).json()
    assert trials["total"] == len(facts["trial_ids"]) and [t["id"] for t in trials["items"]] == facts["trial_ids"][1:3]

    page = c.get("/v1/results", params={"limit": 3, "sort": "-samples_per_s"}).json()
    assert page["total"] == len(facts["trial_ids"]) and len(page["items"]) == 3
    rates = [t["samples_per_s"] for t in page["items"]]
    assert rates == sorted(rates, reverse=True) and page["items"][0]["id"] == facts["best_trial_id"]
    rest = c.get("/v1/results", params={"limit": 3, "offset": 3, "sort": "-samples_per_s"}).json()
    assert len(rest["items"]) == len(facts["trial_ids"]) - 3
    stored = len(facts["trial_ids"])
    assert c.get("/v1/results", params={"workload": "tiny-mlp", "status": "ok"}).json()["total"] == stored
    assert c.get("/v1/results", params={"workload": facts["workload_fp"][:10]}).json()["total"] == stored
    assert c.get("/v1/results", params={"status": "oom"}).json()["total"] == 0
    assert c.get("/v1/results", params={"hardware": "h100-sxm"}).json()["items"] == []
    bf16 = [t for t in c.get("/v1/results").json()["items"] if t["config"]["precision"] == "bf16"]
    assert len(bf16) == 2 and all(t["peak_memory_bytes"] > 0 for t in bf16)


def test_estimate_is_the_library_estimate(seeded, make_client):
    from advisor.estimate import EstimateOptions, EstimateRequest, estimate_memory

    url, _ = seeded
    c = make_client(url)
    body = {"workload": "tiny-gpt2", "workload_args": {"seq_len": 64}, "hardware": "h100-sxm:8", "batch_size": 4,
            "precision": "bf16", "strategy": "zero3"}
    got = c.post("/v1/estimate", json=body)
    assert got.status_code == 200, got.text
    lib = estimate_memory("tiny-gpt2", "h100-sxm:8", EstimateRequest(batch_size=4, precision="bf16", strategy="zero3"),
                          EstimateOptions(calibrate=False), workload_args={"seq_len": 64})
    assert got.json()["total_bytes"] == lib.total_bytes and got.json()["max_batch_size"] == lib.max_batch_size


def test_estimate_takes_the_checkpointing_modes_and_their_booleans(sqlite_url, make_client):
    c = make_client(sqlite_url)
    for sent, mode in ((True, "full"), ("selective", "selective"), (False, "none")):
        got = c.post("/v1/estimate", json={"workload": "tiny-gpt2", "hardware": "h100-sxm", "checkpointing": sent})
        assert got.status_code == 200, got.text
        assert got.json()["request"]["checkpointing"] == mode


def test_layout_estimate_is_the_library_estimate(sqlite_url, make_client):
    from advisor.estimate import EstimateRequest
    from advisor.estimate.parallel import estimate_layout
    from advisor.parallel import Layout

    c = make_client(sqlite_url)
    body = {"workload": "tiny-llama", "hardware": "h100-sxm:4", "tp": 2, "pp": 2, "batch_size": 4}
    got = c.post("/v1/estimate/layout", json=body)
    assert got.status_code == 200, got.text
    lib = estimate_layout("tiny-llama", "h100-sxm:4", Layout(tp=2, pp=2), EstimateRequest(batch_size=4))
    ranks = got.json()["ranks"]
    assert [r["total_bytes"] for r in ranks] == [r.total_bytes for r in lib.ranks]
    assert [r["ranks"] for r in ranks] == [[0, 1], [2, 3]] and ranks[0]["comm_bytes"]["send"] > 0
    ring = c.post("/v1/estimate/layout", json={**body, "tp": 1, "pp": 1, "cp": 2, "dp_replicate": 2,
                                               "strategy": "zero3"})
    assert ring.status_code == 200, ring.text
    assert ring.json()["layout"]["cp"] == 2 and ring.json()["ranks"][0]["comm_bytes"]["all_to_all"] > 0


def test_recommend_measured_then_estimated_with_prices_and_cache(seeded, make_client):
    url, facts = seeded
    c = make_client(url, recommend_cache_s=0.2)
    body = {"workload": "tiny-mlp", "hardware": ["cpu", "h100-sxm", "l4"], "prices": {"h100-sxm": 3.0, "l4": 0.5}}
    first = c.post("/v1/recommend", json=body)
    assert first.status_code == 200, first.text
    recs = {r["hardware"]: r for r in first.json()["recommendations"]}
    cpu = recs["cpu"]
    assert cpu["provenance"] == "measured" and cpu["source_trial_id"] == facts["best_trial_id"]
    assert cpu["samples_per_s"] == pytest.approx(facts["best_samples_per_s"])
    assert recs["l4"]["provenance"] in ("transferred", "estimated") and recs["l4"]["reason"]
    priced = [r for r in first.json()["recommendations"] if r["cost_per_epoch"] is not None]
    assert [r["hardware"] for r in priced] == sorted((r["hardware"] for r in priced),
                                                     key=lambda h: recs[h]["cost_per_epoch"])
    # a better measured trial lands: within the cache's time the answer follows it
    from advisor.store import open_store
    from advisor.trial import TrainingConfig

    from api_seed import THROUGHPUT, measured

    with open_store(url) as store:
        best = store.get_trial(facts["best_trial_id"])
        faster = measured()[0].model_copy(update={"samples_per_s": best.samples_per_s * 10,
                                                  "config": TrainingConfig(device="cpu", batch_size=64)})
        rec = store.finish_trial(store.claim_trial(facts["study_id"], faster.config), faster)
        assert store.update_best(best.workload_fp, best.hardware_fp, THROUGHPUT, rec.id)
    import time

    time.sleep(0.3)
    again = {r["hardware"]: r for r in c.post("/v1/recommend", json=body).json()["recommendations"]}
    assert again["cpu"]["source_trial_id"] == rec.id and again["cpu"]["config"]["batch_size"] == 64
    # answers served from the cache in front of the app are counted under the route like the rest
    answers = {c.post("/v1/recommend", json=body).content for _ in range(3)}
    assert len(answers) == 1 and b'"source_trial_id":%d' % rec.id in answers.pop()
    assert 'advisor_http_requests_total{method="POST",route="/v1/recommend",status="200"} 5.0' in c.get("/metrics").text


def test_token_guards_changes(seeded, make_client):
    url, _ = seeded
    job = {"workload": "tiny-mlp", "hardware": "cpu", "trials": 2}
    open_server = make_client(url)  # no token configured: nobody may queue or cancel
    r = open_server.post("/v1/tune", json=job)
    assert r.status_code == 403 and "ADVISOR_API_TOKEN" in r.json()["detail"]
    assert open_server.delete("/v1/jobs/x").status_code == 403
    c = make_client(url, api_token=TOKEN)
    assert c.post("/v1/tune", json=job).status_code == 401
    assert c.post("/v1/tune", json=job, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert c.post("/v1/tune", json=job, headers={"Authorization": f"Basic {TOKEN}"}).status_code == 401
    ok = c.post("/v1/tune", json=job, headers={"Authorization": f"Bearer {TOKEN}"})
    assert ok.status_code == 202 and ok.headers["location"] == f"/v1/jobs/{ok.json()['job_id']}"
    job_id = ok.json()["job_id"]
    assert c.get(f"/v1/jobs/{job_id}").json()["status"] == "queued"  # reading needs no token
    assert c.delete(f"/v1/jobs/{job_id}").status_code == 401
    gone = c.delete(f"/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {TOKEN}"})
    assert gone.status_code == 202 and gone.json()["status"] == "cancelled"  # queued: cancelled at once
    again = c.delete(f"/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {TOKEN}"})
    assert again.status_code == 409


@pytest.mark.parametrize("workload,allowed,code", [
    ("advisor.presets.vision:tiny_mlp", "", 403),  # importable, but no module is allowed
    ("advisor.presets.vision:tiny_mlp", "advisor.presets", 200),
    ("advisor.presets.vision:tiny_mlp", "advisor.pre", 403),  # a prefix of a name is not a package
    ("tests/api/api_seed.py:seed", "advisor", 403),  # a file path never
    ("../../etc/x.py:build", "advisor", 403),
    ("os:system", "advisor", 403),
])
def test_workload_allowlist(sqlite_url, make_client, workload, allowed, code):
    c = make_client(sqlite_url, workload_modules=allowed, api_token=TOKEN)
    r = c.post("/v1/estimate", json={"workload": workload, "hardware": "h100-sxm"})
    assert r.status_code == code, r.text
    if code == 403:
        tune = c.post("/v1/tune", json={"workload": workload, "hardware": "cpu"},
                      headers={"Authorization": f"Bearer {TOKEN}"})
        assert tune.status_code == 403 and c.get("/v1/jobs").json()["total"] == 0


def test_layout_estimate_offloads_and_accumulates_as_the_library_does(sqlite_url, make_client):
    from advisor.estimate import EstimateRequest
    from advisor.estimate.parallel import estimate_layout
    from advisor.parallel import Layout

    c = make_client(sqlite_url)
    body = {"workload": "tiny-llama", "hardware": "h100-sxm:4", "tp": 2, "strategy": "zero3", "batch_size": 4,
            "offload_optimizer": True, "offload_params": True, "grad_accum": 2}
    got = c.post("/v1/estimate/layout", json=body)
    assert got.status_code == 200, got.text
    req = EstimateRequest(batch_size=4, strategy="zero3", offload_optimizer=True, offload_params=True)
    lib = estimate_layout("tiny-llama", "h100-sxm:4", Layout(dp=2, tp=2, strategy="zero3"), req, grad_accum=2)
    rank = got.json()["ranks"][0]
    assert (rank["total_bytes"], rank["host_bytes"]) == (lib.ranks[0].total_bytes, lib.ranks[0].host_bytes)
    assert rank["host_bytes"] > 0 and rank["breakdown"]["optimizer_state"] == 0 and got.json()["grad_accum"] == 2
    for bad, says in (({"strategy": "zero2"}, "offload_params needs strategy zero3"),
                      ({"grad_accum": 0}, "grad_accum")):
        refused = c.post("/v1/estimate/layout", json={**body, **bad})
        assert refused.status_code == 422 and says in refused.text, refused.text


PATHS = re.compile(r"(/work/|/home/|/root/|/tmp/|site-packages|Traceback|File \")")


@pytest.mark.parametrize("method,path,body,code", [
    ("post", "/v1/estimate", {"workload": "tiny-gpt2", "hardware": "h100-sxm", "batch_size": 0}, 422),
    ("post", "/v1/estimate", {"workload": "tiny-gpt2", "hardware": "nope"}, 422),
    ("post", "/v1/estimate", {"workload": "no-such-preset", "hardware": "h100-sxm"}, 422),
    ("post", "/v1/estimate", {"workload": "tiny-gpt2", "hardware": "h100-sxm", "precision": "fp8"}, 422),
    ("post", "/v1/estimate", {"workload": "tiny-gpt2", "hardware": "h100-sxm", "bogus": 1}, 422),
    ("post", "/v1/estimate", {"workload": "tiny-gpt2", "hardware": "h100-sxm", "checkpointing": "partial"}, 422),
    ("post", "/v1/estimate/layout", {"workload": "tiny-llama", "hardware": "h100-sxm:2", "tp": 2,
                                     "checkpointing": "partial"}, 422),
    ("post", "/v1/estimate", {"workload": "tiny-gpt2", "workload_args": {"no_such_arg": 1}, "hardware": "h100-sxm"},
     422),
    ("post", "/v1/estimate/layout", {"workload": "tiny-llama", "hardware": "h100-sxm:4", "tp": 3}, 422),
    ("post", "/v1/estimate/layout", {"workload": "tiny-llama", "hardware": "h100-sxm:8", "tp": 8}, 422),
    ("post", "/v1/estimate/layout", {"workload": "tiny-llama", "hardware": "h100-sxm:4", "pp": 4}, 422),
    ("post", "/v1/estimate/layout", {"workload": "tiny-mlp", "hardware": "h100-sxm:2", "pp": 2}, 422),
    ("post", "/v1/estimate/layout", {"workload": "tiny-llama", "hardware": "h100-sxm:4", "tp": 2}, 422),
    ("post", "/v1/estimate/layout", {"workload": "tiny-mlp", "hardware": "h100-sxm:2", "cp": 2, "strategy": "zero2"},
     422),
    ("post", "/v1/estimate/layout", {"workload": "tiny-llama", "hardware": "h100-sxm:4", "dp_replicate": 3,
                                     "strategy": "zero3"}, 422),
    ("post", "/v1/recommend", {"workload": "tiny-gpt2", "hardware": []}, 422),
    ("post", "/v1/recommend", {"workload": "tiny-gpt2", "hardware": ["l4"], "prices": {"h100-sxm": 1}}, 422),
    ("post", "/v1/recommend", {"workload": "tiny-gpt2", "hardware": ["l4"], "prices": {"l4": -1}}, 422),
    ("post", "/v1/tune", {"workload": "tiny-mlp", "hardware": "cpu", "space": "../etc/passwd"}, 422),
    ("post", "/v1/tune", {"workload": "tiny-mlp", "hardware": "cpu", "space": "no-such-space"}, 422),
    ("post", "/v1/tune", {"workload": "tiny-mlp", "hardware": "cpu", "fixes": {"not_a_knob": 1}}, 422),
    ("post", "/v1/tune", {"workload": "tiny-mlp", "hardware": "h100-sxm:8"}, 422),  # more devices than the worker's
    ("get", "/v1/results?sort=nonsense", None, 422),
    ("get", "/v1/results?limit=100000", None, 422),
    ("get", "/v1/results?status=exploded", None, 422),
    ("get", "/v1/studies/12345", None, 404),
    ("get", "/v1/studies/abc", None, 422),
    ("get", "/v1/jobs/" + "f" * 32, None, 404),
    ("get", "/v1/nothing-here", None, 404),
])
def test_bad_input_gets_a_4xx_with_a_message_and_no_internals(sqlite_url, make_client, method, path, body, code):
    c = make_client(sqlite_url, api_token=TOKEN)
    kwargs = {"json": body} if body is not None else {}
    r = getattr(c, method)(path, headers={"Authorization": f"Bearer {TOKEN}"}, **kwargs)
    assert r.status_code == code, r.text
    detail = r.json()["detail"]
    assert isinstance(detail, str) and len(detail) > 8 and "\n" not in detail
    assert not PATHS.search(r.text), r.text


def test_malformed_and_oversized_bodies(sqlite_url, make_client):
    c = make_client(sqlite_url, api_max_body_bytes=4096)
    r = c.post("/v1/estimate", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422 and "json" in r.json()["detail"].lower()
    big = {"workload": "tiny-gpt2", "hardware": "h100-sxm", "workload_args": {"x": "a" * 5000}}
    r = c.post("/v1/estimate", json=big)
    assert r.status_code == 413 and "4096" in r.json()["detail"]

    def chunks():  # no Content-Length: the limit applies as the body streams in
        for _ in range(10):
            yield b"a" * 1000

    r = c.post("/v1/estimate", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413


def test_metrics_count_requests_jobs_and_trials(seeded, make_client):
    url, facts = seeded
    c = make_client(url)
    c.get("/v1/studies")
    c.get("/v1/studies")
    c.get(f"/v1/studies/{facts['study_id']}")
    c.get("/v1/studies/999999")
    text = c.get("/metrics").text
    assert 'advisor_http_requests_total{method="GET",route="/v1/studies",status="200"} 2.0' in text
    assert 'advisor_http_requests_total{method="GET",route="/v1/studies/{study_id}",status="404"} 1.0' in text
    assert f'advisor_trials{{status="ok"}} {float(len(facts["trial_ids"]))}' in text
    assert 'advisor_jobs{status="queued"} 0.0' in text and "advisor_store_up 1.0" in text
    assert "advisor_http_request_duration_seconds_bucket" in text
