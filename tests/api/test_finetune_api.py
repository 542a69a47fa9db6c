"""Fine-tuning over the HTTP API: the estimate, recommend and tune requests take `finetune` (frozen modules, LoRA
adapters), answer as the library does, and refuse bad fine-tunes with a 422 and one line."""

from __future__ import annotations

import pytest

from api_common import TOKEN

LORA = {"lora": {"r": 8, "alpha": 16, "targets": ["wq", "wv"]}}


def test_estimate_with_lora_is_the_library_estimate(sqlite_url, make_client):
    from advisor.estimate import EstimateOptions, EstimateRequest, estimate_memory
    from advisor.finetune import FineTune, with_finetune

    c = make_client(sqlite_url)
    body = {"workload": "tiny-llama", "hardware": "h100-sxm", "batch_size": 4, "precision": "bf16"}
    full = c.post("/v1/estimate", json=body)
    got = c.post("/v1/estimate", json={**body, "finetune": LORA})
    assert full.status_code == 200 and got.status_code == 200, got.text
    lib = estimate_memory("tiny-llama", "h100-sxm", EstimateRequest(batch_size=4, precision="bf16"),
                          EstimateOptions(calibrate=False),
                          workload_args=with_finetune({}, FineTune.model_validate(LORA)))
    assert got.json()["workload"] == "tiny-llama+lora"
    assert got.json()["total_bytes"] == lib.total_bytes and got.json()["max_batch_size"] == lib.max_batch_size
    assert got.json()["breakdown"]["optimizer_state"] < full.json()["breakdown"]["optimizer_state"] / 10
    schema = c.get("/openapi.json").json()
    for path in ("/v1/estimate", "/v1/recommend", "/v1/tune"):  # each request body documents the field
        ref = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert "finetune" in schema["components"]["schemas"][ref.rpartition("/")[2]]["properties"], path


def test_recommend_with_lora_answers_a_batch(sqlite_url, make_client):
    c = make_client(sqlite_url)
    got = c.post("/v1/recommend", json={"workload": "tiny-llama", "hardware": ["l4"], "finetune": LORA})
    assert got.status_code == 200, got.text
    (rec,) = got.json()["recommendations"]
    assert rec["fits"] is True and rec["config"]["batch_size"] >= 1 and rec["provenance"] == "estimated"
    frozen = c.post("/v1/recommend", json={"workload": "tiny-llama", "hardware": ["l4"],
                                           "finetune": {"freeze": ["blocks.0*"]}})
    assert frozen.status_code == 200, frozen.text


@pytest.mark.parametrize("path, finetune, says", [
    ("/v1/estimate", {"lora": {"r": 8, "targets": ["q_proj"]}}, "q_proj"),
    ("/v1/estimate", {"lora": {"r": 0, "targets": ["wq"]}}, "greater than or equal to 1"),
    ("/v1/estimate", {"lora": {"r": 8}}, "targets"),
    ("/v1/estimate", {"lora": {"r": 8, "targets": ["wq"], "rank": 4}}, "rank"),
    ("/v1/estimate", {"freeze": ["nothing.here"]}, "matches no module"),
    ("/v1/recommend", {"lora": {"r": 8, "targets": ["q_proj"]}}, "q_proj"),
    ("/v1/tune", {"lora": {"r": 8, "targets": ["q_proj"]}}, "q_proj"),
])
def test_bad_fine_tunes_are_a_422_with_one_line(sqlite_url, make_client, path, finetune, says):
    c = make_client(sqlite_url, api_token=TOKEN)
    hardware = ["l4"] if path == "/v1/recommend" else "cpu" if path == "/v1/tune" else "h100-sxm"
    r = c.post(path, json={"workload": "tiny-llama", "hardware": hardware, "finetune": finetune},
               headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert isinstance(detail, str) and "\n" not in detail and says in detail, detail


def test_a_tune_job_fixing_lora_r_without_lora_is_a_422(sqlite_url, make_client):
    c = make_client(sqlite_url, api_token=TOKEN)
    r = c.post("/v1/tune", json={"workload": "tiny-llama", "hardware": "cpu", "fixes": {"lora_r": 8}},
               headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 422 and "needs a LoRA fine-tune" in r.json()["detail"], r.text
