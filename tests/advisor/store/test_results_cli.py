"""`advisor db` and `advisor results` as real subprocesses against a store filled with TrialResults:
filters, sorting, JSON and tables, one-line errors with exit 2, and no SQLAlchemy at --help time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from store_data import THROUGHPUT, config, result, spec

from advisor.store import open_store
from advisor.trial import TrialStatus

ROOT = Path(__file__).resolve().parents[3]


def advisor(*args: str, **env: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "advisor.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "COLUMNS": "200", **env})
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def ok_json(*args: str, **env: str):  # noqa: ANN201
    proc = advisor(*args, "--json", **env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def filled(tmp_path_factory) -> tuple[str, dict[str, int]]:
    url = f"sqlite:///{tmp_path_factory.mktemp('results') / 'advisor.db'}"
    ids = {}
    with open_store(url) as store:
        gpt = store.create_or_get_study(spec("gpt-cpu"))
        res = store.create_or_get_study(spec("resnet-cpu", workload="resnet-tiny"))
        for label, study, cfg, status, sps in (("g4", gpt, config(4), TrialStatus.ok, 100.0),
                                               ("g8", gpt, config(8, num_workers=2), TrialStatus.ok, 300.0),
                                               ("g16", gpt, config(16), TrialStatus.oom, None),
                                               ("r4", res, config(4), TrialStatus.ok, 200.0)):
            rec = store.finish_trial(store.claim_trial(study.id, cfg), result(cfg, status, sps))
            ids[label] = rec.id
            if status == TrialStatus.ok:
                store.update_best(study.workload_fp, study.hardware_fp, THROUGHPUT, rec.id)
    return url, ids


def test_list_filters_and_sorts(filled):
    url, ids = filled
    assert [t["id"] for t in ok_json("results", "list", "--db", url)] == [ids["g4"], ids["g8"], ids["g16"], ids["r4"]]
    rows = ok_json("results", "list", "--db", url, "--workload", "tiny-gpt2", "--status", "ok",
                   "--sort", "-samples_per_s")
    assert [(t["id"], t["samples_per_s"]) for t in rows] == [(ids["g8"], 300.0), (ids["g4"], 100.0)]
    assert [t["id"] for t in ok_json("results", "list", "--db", url, "--status", "oom", "--status", "ok",
                                     "--sort", "samples_per_s", "--limit", "2")] == [ids["g4"], ids["r4"]]
    assert [t["id"] for t in ok_json("results", "list", "--db", url, "--study", "resnet-cpu", "--hardware", "cpu")] \
        == [ids["r4"]]
    # the settings' database URL when no --db is given
    assert len(ok_json("results", "list", ADVISOR_DATABASE_URL=url)) == 4


def test_list_show_and_best_tables(filled):
    url, ids = filled
    table = advisor("results", "list", "--db", url, "--sort", "-samples_per_s")
    assert table.returncode == 0
    lines = [line for line in table.stdout.splitlines() if "tiny-gpt2" in line or "resnet-tiny" in line]
    assert "300.0" in lines[0] and "oom" in lines[-1] and "num_workers=2" in table.stdout
    show = advisor("results", "show", str(ids["g8"]), "--db", url)
    assert show.returncode == 0 and "matmuls dominate" in show.stdout and "gpt-cpu" in show.stdout
    detail = ok_json("results", "show", str(ids["g8"]), "--db", url)
    assert detail["result"]["step_time_s"]["p50"] == pytest.approx(8 / 300) and detail["config"]["num_workers"] == 2
    best = {b["trial"]["workload_name"]: b["trial"]["id"] for b in ok_json("results", "best", "--db", url)}
    assert best == {"tiny-gpt2": ids["g8"], "resnet-tiny": ids["r4"]}
    assert "samples_per_s:maximize" in advisor("results", "best", "--db", url, "--workload", "resnet-tiny").stdout


@pytest.mark.parametrize("args, says", [
    (("list", "--status", "finished"), "--status 'finished'"),
    (("list", "--sort", "-speed"), "cannot sort by '-speed'"),
    (("list", "--limit", "0"), "not positive"),
    (("show", "999"), "no trial with id 999"),
])
def test_bad_values_give_one_line_and_exit_2(filled, args, says):
    url, _ = filled
    proc = advisor("results", *args, "--db", url)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0]


def test_db_current_and_upgrade(tmp_path):
    url = f"sqlite:///{tmp_path / 'fresh.db'}"
    assert "revision none (empty)" in advisor("db", "current", "--db", url).stdout
    up = advisor("db", "upgrade", "--db", url)
    assert up.returncode == 0 and "at revision 0002" in up.stdout
    assert "revision 0002; this advisor's head: 0002" in advisor("db", "current", "--db", url).stdout
    bad = advisor("db", "current", "--db", "mysql://x/y")
    assert bad.returncode == 2 and "not supported" in bad.stderr


def test_help_does_not_load_sqlalchemy():
    code = ("import sys\nfrom advisor.cli import main\ntry:\n    main(['results', '--help'])\n"
            "except SystemExit:\n    pass\n"
            "print('sqlalchemy' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60).stdout
    assert out.strip().splitlines()[-1] == "False False"
