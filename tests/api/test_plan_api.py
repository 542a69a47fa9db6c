"""POST /v1/plan over the app: the planner's plans for a preset (searched, and with a knob held), a workload module
described in an isolated worker, what would fit where nothing does, and bad input as a 422 with one line."""

from __future__ import annotations

import pytest

LLAMA = {"workload": "llama-8b", "hardware": ["h100-sxm:8"]}
PLAN_KEYS = {"config", "memory_per_device_bytes", "fits", "step_time_s", "tokens_per_s_per_device", "samples_per_s",
             "breakdown"}  # the issue's `advisor plan --json` shape
BREAKDOWN = ("compute_s", "exposed_comm_s", "bubble_s", "optimizer_s")


def test_llama_8b_on_one_h100_node_fits_sharded(sqlite_url, make_client):
    c = make_client(sqlite_url)
    r = c.post("/v1/plan", json={**LLAMA, "top": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["fits"] and body["workload"] == "llama-8b" and body["what_would_fit"] == []
    plans = body["plans"]
    assert 1 <= len(plans) <= 3
    for p in plans:
        assert PLAN_KEYS <= set(p)
        assert p["fits"] and p["memory_per_device_bytes"] <= p["usable_bytes"] and p["devices"] == 8
        cfg = p["config"]
        assert cfg["dp"] * cfg["tp"] * cfg["pp"] * cfg["cp"] == 8
        # 8B parameters with Adam do not fit one 80 GB device unsharded: every plan splits the model or its state
        assert cfg["tp"] > 1 or cfg["pp"] > 1 or cfg["strategy"] in ("zero2", "zero3") or cfg["offload"] != "none"
        assert cfg["dp"] * cfg["micro_batch_size"] * cfg["microbatches"] * cfg["grad_accum"] == \
            body["global_batch_size"]
        parts = sum(p["breakdown"][k] for k in BREAKDOWN)
        assert parts == pytest.approx(p["step_time_s"], rel=1e-6)
        assert sum(p["memory"].values()) == p["memory_per_device_bytes"]
    rates = [p["tokens_per_s_per_device"] for p in plans]
    assert rates == sorted(rates, reverse=True)


def test_a_fixed_knob_holds_in_every_plan(sqlite_url, make_client):
    c = make_client(sqlite_url)
    r = c.post("/v1/plan", json={**LLAMA, "fix": {"tp": 2}, "top": 5})
    assert r.status_code == 200, r.text
    plans = r.json()["plans"]
    assert plans and {p["config"]["tp"] for p in plans} == {2}


def test_a_workload_module_is_described_in_a_worker(sqlite_url, make_client):
    c = make_client(sqlite_url, workload_modules="advisor.presets")
    body = {"workload": "advisor.presets.transformers:llama_8b", "hardware": ["h100-sxm:8"], "fix": {"tp": 2},
            "top": 2}
    r = c.post("/v1/plan", json=body)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["workload"] == "llama-8b" and got["fits"] and {p["config"]["tp"] for p in got["plans"]} == {2}
    refused = make_client(sqlite_url).post("/v1/plan", json=body)  # no module allowed on this server
    assert refused.status_code == 403, refused.text


def test_nothing_fits_says_what_would(sqlite_url, make_client):
    c = make_client(sqlite_url)
    r = c.post("/v1/plan", json={"workload": "llama-70b", "hardware": ["h100-sxm:1"]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert not body["fits"] and all(not p["fits"] for p in body["plans"])
    assert body["what_would_fit"] and "h100-sxm" in body["what_would_fit"][0]


@pytest.mark.parametrize("extra,says", [
    ({"fix": {"tensor_parallel": 2}}, "fix: unknown knob 'tensor_parallel'; knobs: dp, tp, pp"),
    ({"fix": {"dp": 8}, "global_batch_size": 12}, "global batch 12 does not split over dp 8"),
    ({"nodes": [4, 2]}, "nodes: [4, 2] has no node count; give [FIRST, LAST] with 1 <= FIRST <= LAST"),
    ({"nodes": [0, 0]}, "nodes: [0, 0] has no node count"),
    ({"nodes": [1, 100_000]}, "nodes: [1, 100000] goes past"),
    ({"nodes": [1, 64], "hardware": ["h100-sxm:8"]}, "targets; plan at most"),
    ({"hardware": ["h100-sxm:8x4096"]}, "has 32768 devices; plan at most"),
    ({"top": 10_000}, "top: Input should be less than or equal to"),
    ({"fix": {"checkpointing": "sometimes"}}, "fix.checkpointing:"),
    ({"hardware": ["cpu"]}, "the planner plans GPU training"),
    ({"workload": "resnet50"}, "resnet50 is not a decoder"),
])
def test_bad_input_is_a_422_with_one_line(sqlite_url, make_client, extra, says):
    c = make_client(sqlite_url)
    r = c.post("/v1/plan", json={**LLAMA, **extra})
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert says in detail and "\n" not in detail
