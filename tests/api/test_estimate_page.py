"""The page's Estimate view in headless Chromium, against `advisor serve` over real HTTP: the form posts to
/v1/estimate/curve and draws the answer (a stacked bar with one part per category the API reports, the fit and the
largest batch as POST /v1/estimate answers them for the same request, memory against batch size with one point per
batch size); its address reopens the form and runs it; the API's 422 shows beside the form.

Needs playwright and Chromium at /usr/bin/chromium (conftest.py's `browser` fixture).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

ANSWER_TIMEOUT_MS = 180_000  # the first estimate waits for the isolated worker's fork server (torch's import)
MIN_SCREENSHOT_BYTES = 20_000  # a blank 1280-px page is a few kB; a form, a bar, a table and a plot far more

FORM = {"workload": "tiny-gpt2", "args": "seq_len=64", "hardware": "l4", "batch": "8", "precision": "bf16",
        "optimizer": "adam", "checkpointing": "full"}
REQUEST = {"workload": "tiny-gpt2", "workload_args": {"seq_len": 64}, "hardware": "l4", "batch_size": 8,
           "precision": "bf16", "optimizer": "adam", "strategy": "single", "checkpointing": "full"}
SELECTS = ("precision", "optimizer", "strategy", "checkpointing")


def _open(page: Any, base: str) -> None:
    page.goto(f"{base}/")
    page.click("#tab-estimate")
    page.wait_for_selector('#est-workload-names option[value="tiny-gpt2"]', state="attached")
    page.wait_for_selector('#est-precision option[value="bf16"]', state="attached")
    assert page.locator("#tune-view").is_hidden() and page.locator("#plan-view").is_hidden()
    assert page.locator("#est-form").is_visible()


def _submit(page: Any, **fields: str) -> dict:
    """Fill the form, submit it, and return the API's answer once the page has drawn it (or its error)."""
    for name, value in fields.items():
        if name in SELECTS:
            page.select_option(f"#est-{name}", value)
        else:
            page.fill(f"#est-{name}", value)
    with page.expect_response("**/v1/estimate/curve", timeout=ANSWER_TIMEOUT_MS) as answer:
        page.click("#est-submit")
    return _drawn(page, answer)


def _drawn(page: Any, answer: Any) -> dict:
    page.wait_for_selector("#est-result[data-fits], #est-error:not([hidden])", timeout=ANSWER_TIMEOUT_MS)
    return answer.value.json()


def _check_answer(page: Any, base: str, curve: dict) -> None:
    """The drawn answer against the curve the page got and against POST /v1/estimate for the same request."""
    est = curve["estimate"]
    alone = httpx.post(f"{base}/v1/estimate", json=REQUEST, timeout=120).raise_for_status().json()
    assert (alone["fits"], alone["max_batch_size"]) == (est["fits"], est["max_batch_size"])
    assert page.inner_text("#est-fits") == ("fits" if alone["fits"] else "does not fit")
    assert page.get_attribute("#est-largest", "data-largest") == str(alone["max_batch_size"])
    assert f"largest batch that fits: {alone['max_batch_size']}" in page.inner_text("#est-largest")

    parts = {k: v for k, v in {**est["breakdown"], "runtime": est["runtime_bytes"]}.items() if v > 0}
    drawn = page.eval_on_selector_all("#est-bar svg.bar-memory rect[data-part]",
                                      "els => els.map(e => [e.dataset.part, Number(e.dataset.value)])")
    assert dict(drawn) == parts and len(drawn) == len(parts)
    assert page.locator("#est-bar svg.bar-memory line.usable").count() == 1
    assert page.locator("#est-parts tbody tr[data-part]").count() == len(parts)

    points = page.eval_on_selector_all("#est-plot svg circle[data-batch]",
                                       "els => els.map(e => [Number(e.dataset.batch), e.dataset.fits])")
    assert points == [[p["batch_size"], str(p["fits"]).lower()] for p in curve["points"]]
    assert {est["max_batch_size"], est["max_batch_size"] + 1} <= {b for b, _ in points}
    assert page.locator("#est-plot svg line.usable-line").count() == 1
    assert page.locator("#est-plot svg line.largest-line").count() == 1


def test_estimate_view_draws_the_answer_and_its_address_reopens_it(live_server: tuple[str, dict], browser: Any,
                                                                   page: Any, artifact_dir: Path) -> None:
    base, _ = live_server
    _open(page, base)
    curve = _submit(page, **FORM)
    assert page.locator("#est-error").is_hidden()
    assert curve["estimate"]["request"]["checkpointing"] == "full"
    _check_answer(page, base, curve)
    shot = artifact_dir / "estimate.png"
    shot.unlink(missing_ok=True)
    page.screenshot(path=str(shot), full_page=True)
    assert shot.is_file() and shot.stat().st_size > MIN_SCREENSHOT_BYTES
    assert not page.script_errors

    url = page.url
    assert "#estimate?" in url and "workload=tiny-gpt2" in url
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    try:
        shared = context.new_page()
        shared.script_errors = []
        shared.on("pageerror", lambda exc: shared.script_errors.append(str(exc)))
        with shared.expect_response("**/v1/estimate/curve", timeout=ANSWER_TIMEOUT_MS) as answer:
            shared.goto(url)
        again = _drawn(shared, answer)
        for name, value in FORM.items():
            assert shared.input_value(f"#est-{name}") == value, name
        assert shared.input_value("#est-strategy") == "single"
        assert shared.get_attribute("#tab-estimate", "aria-pressed") == "true"
        assert again["estimate"]["request"] == curve["estimate"]["request"]
        _check_answer(shared, base, again)
        assert not shared.script_errors
    finally:
        context.close()


def test_estimate_view_shows_the_api_422_beside_the_form(live_server: tuple[str, dict], page: Any) -> None:
    base, _ = live_server
    _open(page, base)
    _submit(page, **{**FORM, "args": "seq_len=64\nno_such_arg=3"})
    told = httpx.post(f"{base}/v1/estimate/curve", json={**REQUEST, "workload_args": {"seq_len": 64, "no_such_arg": 3}},
                      timeout=120)
    assert told.status_code == 422
    error = page.locator("#est-error")
    assert error.is_visible()
    assert "422" in error.inner_text() and told.json()["detail"] in error.inner_text()
    assert page.locator("#est-result svg").count() == 0

    page.fill("#est-args", "seq_len")  # not KEY=VALUE: the page says so before asking
    page.click("#est-submit")
    page.wait_for_function("document.querySelector('#est-error').innerText.includes('is not KEY=VALUE')")
    assert not page.script_errors


def test_estimate_view_takes_lora(live_server: tuple[str, dict], page: Any) -> None:
    base, _ = live_server
    _open(page, base)
    assert page.locator("#est-lora_r").is_visible() and page.locator("#est-freeze").is_visible()
    form = {"workload": "tiny-llama", "args": "", "hardware": "l4", "batch": "4", "precision": "bf16",
            "lora_r": "8", "lora_alpha": "16", "lora_targets": "wq,wv"}
    curve = _submit(page, **form)
    assert page.locator("#est-error").is_hidden(), page.inner_text("#est-error")
    request = {"workload": "tiny-llama", "hardware": "l4", "batch_size": 4, "precision": "bf16"}
    lora = {"lora": {"r": 8, "alpha": 16, "targets": ["wq", "wv"]}}
    tuned = httpx.post(f"{base}/v1/estimate", json={**request, "finetune": lora}, timeout=120).raise_for_status()
    full = httpx.post(f"{base}/v1/estimate", json=request, timeout=120).raise_for_status().json()
    est = curve["estimate"]
    assert est["total_bytes"] == tuned.json()["total_bytes"] and est["workload"] == tuned.json()["workload"]
    assert est["breakdown"]["gradients"] < full["breakdown"]["gradients"]
    assert "lora_r=8" in page.url and "lora_targets=wq%2Cwv" in page.url
    assert not page.script_errors
