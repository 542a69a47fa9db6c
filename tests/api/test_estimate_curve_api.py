"""POST /v1/estimate/curve over the app: its estimate is POST /v1/estimate's answer, its points the memory by part at
each batch size (by default bracketing the largest batch that fits), bad input a 422 with one line, and every
generated request answered within the OpenAPI schema."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

BODY = {"workload": "tiny-gpt2", "workload_args": {"seq_len": 64}, "hardware": "l4", "batch_size": 8,
        "precision": "bf16"}
PARTS = {"parameters", "gradients", "optimizer_state", "activations", "temporaries", "overhead"}


def test_the_curve_carries_the_estimate_and_brackets_the_largest_batch(sqlite_url, make_client):
    c = make_client(sqlite_url)
    got = c.post("/v1/estimate/curve", json=BODY)
    assert got.status_code == 200, got.text
    curve = got.json()
    alone = c.post("/v1/estimate", json=BODY).json()
    est = curve["estimate"]
    for key in ("total_bytes", "breakdown", "runtime_bytes", "usable_bytes", "fits", "max_batch_size"):
        assert est[key] == alone[key], key
    points = curve["points"]
    batches = [p["batch_size"] for p in points]
    largest = est["max_batch_size"]
    assert batches == sorted(set(batches)) and {1, 8, largest, largest + 1} <= set(batches)
    own = points[batches.index(8)]
    assert own["total_bytes"] == est["total_bytes"] and own["breakdown"] == est["breakdown"]
    for p in points:
        assert set(p["breakdown"]) == PARTS and sum(p["breakdown"].values()) == p["total_bytes"]
        assert p["fits"] == (p["total_bytes"] + p["runtime_bytes"] <= est["usable_bytes"])
    assert points[batches.index(largest)]["fits"]
    assert points[-1]["total_bytes"] > points[0]["total_bytes"]

    chosen = c.post("/v1/estimate/curve", json={**BODY, "batch_sizes": [16, 2, 16]})
    assert chosen.status_code == 200, chosen.text
    assert [p["batch_size"] for p in chosen.json()["points"]] == [2, 16]


@pytest.mark.parametrize("extra, message", [
    ({"batch_sizes": []}, "batch_sizes: List should have at least 1 item"),
    ({"batch_sizes": [4, 0]}, "batch_sizes.1: Input should be greater than 0"),
    ({"batch_sizes": list(range(1, 66))}, "batch_sizes: List should have at most 64 items"),
    ({"workload_args": {"no_such_arg": 3}}, "no_such_arg"),
    ({"strategy": "zero3"}, "zero3 needs 2+ devices"),
])
def test_bad_input_is_a_422_with_one_line(sqlite_url, make_client, extra, message):
    got = make_client(sqlite_url).post("/v1/estimate/curve", json={**BODY, **extra})
    assert got.status_code == 422, got.text
    detail = got.json()["detail"]
    assert message in detail and "\n" not in detail


def test_generated_requests_answer_within_the_schema(sqlite_url):
    from advisor.settings import Settings
    from api.app import create_app

    app = create_app(sqlite_url, settings=Settings(database_url=sqlite_url))
    operation = schemathesis.openapi.from_asgi("/openapi.json", app)["/v1/estimate/curve"]["POST"]

    # few cases: a generated preset name (the schema's examples name real ones) is traced, about a second each
    @given(case=operation.as_strategy())
    @settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def check(case):  # noqa: ANN001
        case.call_and_validate(excluded_checks=[positive_data_acceptance], timeout=60)

    check()
