"""The web page at / in headless Chromium, against `advisor serve` over a store of real measured
trials: the plots carry one mark per trial the API reports, the best-configs table leads with the
fastest trial, a click switches the study, and API errors and user text show as text. The plan view
posts its form to /v1/plan and draws the answer: a row and two stacked bars per plan, or what would fit.

Needs the `playwright` package and Chromium at /usr/bin/chromium (conftest.py's `browser` fixture).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

PLAN_TIMEOUT_MS = 180_000  # the first plan waits for the isolated worker's fork server (torch's import) too
MIN_SCREENSHOT_BYTES = 20_000  # a blank 1280-px page is a few kB; tables and three plots are far more


def _rate_key(trials: list[dict]) -> str:
    """The page's throughput: tokens/s where the workload counts tokens, else samples/s."""
    return "tokens_per_s" if any(t["status"] == "ok" and t["tokens_per_s"] is not None for t in trials) \
        else "samples_per_s"


def _ids(page: Any, selector: str) -> list[int]:
    return [int(x) for x in page.eval_on_selector_all(selector, "els => els.map(e => e.dataset.trialId)")]


def _check_detail(page: Any, base: str, study_id: int) -> None:
    """The shown study's plots and tables against what the API returns for it."""
    page.wait_for_selector(f'#study-detail[data-study-id="{study_id}"]')
    trials = httpx.get(f"{base}/v1/studies/{study_id}/trials", params={"limit": 500}).raise_for_status().json()["items"]
    key = _rate_key(trials)
    measured = [t for t in trials if t["status"] == "ok" and t[key] is not None]
    assert measured, f"study {study_id} has no measured trials to plot"

    assert sorted(_ids(page, "#plot-throughput-batch svg circle[data-trial-id]")) == sorted(t["id"] for t in measured)
    with_memory = [t for t in measured if t["peak_memory_bytes"] is not None]
    assert sorted(_ids(page, "#plot-pareto svg circle[data-trial-id]")) == sorted(t["id"] for t in with_memory)
    finished = [t for t in trials if t["finished_at"] is not None]
    assert sorted(_ids(page, "#plot-timeline svg rect[data-trial-id]")) == sorted(t["id"] for t in finished)

    fastest = max(measured, key=lambda t: t[key])
    assert _ids(page, "#best-configs tbody tr[data-trial-id]")[0] == fastest["id"]
    if fastest["peak_memory_bytes"] is not None:  # nothing beats the fastest on throughput: it is on the front
        assert page.locator(f'#plot-pareto circle[data-trial-id="{fastest["id"]}"][data-pareto]').count() == 1
    assert sorted(_ids(page, "#trials tbody tr[data-trial-id]")) == sorted(t["id"] for t in trials)


def test_page_plots_the_measured_trials_and_switches_study(live_server: tuple[str, dict], sqlite_url: str,
                                                           page: Any, artifact_dir: Path) -> None:
    from api_seed import seed

    base, facts = live_server
    second = seed(sqlite_url, study="seeded-tiny-mlp-again")  # a newer study: the page opens on it
    studies = httpx.get(f"{base}/v1/studies").raise_for_status().json()["items"]
    assert {s["id"] for s in studies} == {facts["study_id"], second["study_id"]}

    page.goto(f"{base}/")
    page.wait_for_selector("#studies table tbody tr[data-study-id]")
    assert page.locator("#studies tbody tr[data-study-id]").count() == len(studies)
    _check_detail(page, base, second["study_id"])

    page.click(f'#studies tr[data-study-id="{facts["study_id"]}"]')
    _check_detail(page, base, facts["study_id"])
    assert _ids(page, "#best-configs tbody tr[data-trial-id]")[0] == facts["best_trial_id"]
    assert "seeded-tiny-mlp" in page.inner_text("#study-title")
    assert page.locator(f'#studies tr.selected[data-study-id="{facts["study_id"]}"]').count() == 1
    assert page.locator("#error").is_hidden()
    assert not page.script_errors

    shot = artifact_dir / "page.png"
    shot.unlink(missing_ok=True)
    page.screenshot(path=str(shot), full_page=True)
    assert shot.is_file() and shot.stat().st_size > MIN_SCREENSHOT_BYTES


def test_page_shows_api_errors_and_user_text_as_text(live_server: tuple[str, dict], page: Any) -> None:
    base, facts = live_server
    hostile = '<img src=x onerror="window.__pwned = 1">'

    def jobs_down(route: Any) -> None:
        route.fulfill(status=503, content_type="application/json",
                      body=json.dumps({"detail": "the job queue is <b>unavailable</b>"}))

    def hostile_names(route: Any) -> None:  # the real answer, with a workload name a user could have chosen
        body = route.fetch().json()
        for study in body["items"]:
            study["name"] = study["workload_name"] = hostile
        route.fulfill(status=200, content_type="application/json", body=json.dumps(body))

    page.route("**/v1/jobs?*", jobs_down)
    page.route("**/v1/studies?*", hostile_names)
    page.goto(f"{base}/")
    page.wait_for_selector(f'#study-detail[data-study-id="{facts["study_id"]}"]')

    error = page.locator("#error")
    error.wait_for(state="visible")
    assert "503" in error.inner_text() and "the job queue is <b>unavailable</b>" in error.inner_text()
    row = page.locator(f'#studies tr[data-study-id="{facts["study_id"]}"]')
    assert row.locator("td").nth(1).inner_text() == hostile
    assert hostile in page.inner_text("#study-title")
    assert page.locator("img").count() == 0
    assert page.evaluate("window.__pwned") is None
    assert not page.script_errors


def _submit_plan(page: Any, **fields: str) -> dict:
    """Fill the plan form, submit it, and return the API's answer once the page has drawn it."""
    for name, value in fields.items():
        if name == "workload":
            page.select_option("#plan-workload", value)
        else:
            page.fill(f"#plan-{name}", value)
    with page.expect_response("**/v1/plan", timeout=PLAN_TIMEOUT_MS) as answer:
        page.click("#plan-submit")
    page.wait_for_selector("#plan-result[data-fits], #plan-error:not([hidden])", timeout=PLAN_TIMEOUT_MS)
    return answer.value.json()


def test_plan_view_draws_the_plans_and_what_would_fit(live_server: tuple[str, dict], page: Any,
                                                     artifact_dir: Path) -> None:
    base, _ = live_server
    page.goto(f"{base}/")
    page.click("#tab-plan")
    page.wait_for_selector('#plan-workload option[value="llama-8b"]', state="attached")
    assert page.locator("#tune-view").is_hidden() and page.locator("#plan-form").is_visible()

    body = _submit_plan(page, workload="llama-8b", hardware="h100-sxm:8")
    assert body["fits"] and body["plans"]
    rows = page.locator("#plan-table tbody tr[data-plan-index]")
    assert rows.count() == len(body["plans"])
    first, cfg = rows.nth(0), body["plans"][0]["config"]
    assert first.locator("td").nth(2).inner_text() == f'{cfg["dp"]}/{cfg["tp"]}/{cfg["pp"]}/{cfg["cp"]}'
    for i, plan in enumerate(body["plans"]):  # each plan's bars carry its parts, adding up to its figures
        bars = f'#plan-bars .plan-bar-row[data-plan-index="{i}"]'
        memory = page.eval_on_selector_all(f"{bars} svg.bar-memory rect[data-part]",
                                           "els => els.map(e => Number(e.dataset.value))")
        assert sum(memory) == plan["memory_per_device_bytes"]
        time = page.eval_on_selector_all(f"{bars} svg.bar-time rect[data-part]",
                                         "els => els.map(e => [e.dataset.part, Number(e.dataset.value)])")
        assert dict(time)["compute_s"] == plan["breakdown"]["compute_s"]
        assert sum(v for _, v in time) == pytest.approx(plan["step_time_s"], rel=1e-6)
        assert page.locator(f"{bars} svg.bar-memory line.usable").count() == 1
    shot = artifact_dir / "plan.png"
    shot.unlink(missing_ok=True)
    page.screenshot(path=str(shot), full_page=True)
    assert shot.is_file() and shot.stat().st_size > MIN_SCREENSHOT_BYTES

    body = _submit_plan(page, workload="llama-70b", hardware="h100-sxm:1")  # 140 GB of bf16 weights on one GPU
    assert not body["fits"] and body["what_would_fit"]
    assert body["what_would_fit"][0] in page.inner_text("#plan-would-fit")

    _submit_plan(page, fix="tensor_parallel=2")
    error = page.locator("#plan-error")
    assert "422" in error.inner_text() and "unknown knob 'tensor_parallel'" in error.inner_text()
    assert page.locator("#plan-table").count() == 0
    assert not page.script_errors
