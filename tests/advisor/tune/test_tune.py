"""The tuner end to end on this CPU: real trials run inline and through Ray Tune, Optuna's samplers, a real
store; resume after SIGKILL, a crashing configuration, two tuners sharing one PostgreSQL study, bad stores."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
SPACE = str(HERE / "space.yaml")
RECORDER = f"{ROOT / 'tests' / 'probes' / 'recorder.py'}:build"
# No wait for quiet before each trial (--settle 0): the suite's other worker keeps the machine busy, so
# each could wait up to the whole 5 s, and these tests check what is measured and stored, not its speed.
FAST = ["--min-time", "0.3", "--min-steps", "3", "--trial-timeout", "120", "--settle", "0"]


@pytest.fixture
def data_dir():
    """A short data dir (Ray's socket paths live under it), removed afterwards."""
    d = tempfile.mkdtemp(prefix="advt-", dir="/tmp")
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


def tune_cmd(db: str, *extra: str, workload: str = "tiny-mlp") -> list[str]:
    return [sys.executable, "-m", "advisor.cli", "tune", "-w", workload, "-H", "cpu", "--space", SPACE,
            "--db", db, "--json", *FAST, *extra]


def run_tune(data_dir: Path, db: str, *extra: str, workload: str = "tiny-mlp", timeout: float = 400):
    env = {**os.environ, "ADVISOR_DATA_DIR": str(data_dir)}
    proc = subprocess.run(tune_cmd(db, *extra, workload=workload), capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def stored(db: str):
    from advisor.store import TrialQuery, open_store

    with open_store(db) as store:
        return store.query_trials(TrialQuery(sort="id"))


def test_tune_measures_stores_and_resumes(data_dir, capsys):
    db = f"sqlite:///{data_dir / 'advisor.db'}"
    first = run_tune(data_dir, db, "--trials", "3", "--executor", "ray")  # Ray Tune's runner on a local Ray
    assert first["statuses"] == {"ok": 3}
    # where the run's time went besides its measured trials: parts that add up to no more than the run
    st = first["stats"]
    assert min(st["start_s"], st["estimate_s"], st["stop_s"], first["trial_s"]) > 0
    assert st["start_s"] + st["estimate_s"] + first["trial_s"] + st["stop_s"] <= first["wall_s"]
    from advisor.tune.render import summary_table
    from advisor.tune.summary import TuneSummary

    summary_table(TuneSummary.model_validate(first))
    assert f"memory estimates {st['estimate_s']:.1f} s" in capsys.readouterr().out
    assert first["baseline"] is not None  # PyTorch defaults: batch 8 (the preset's), fp32, no workers
    assert first["baseline"]["config"]["batch_size"] == 8 and first["baseline"]["config"]["precision"] == "fp32"
    values = [t["value"] for t in first["top"]]
    assert values == sorted(values, reverse=True) and first["best"]["value"] == values[0]
    assert first["best"]["speedup"] == pytest.approx(values[0] / first["baseline"]["samples_per_s"])
    records = stored(db)
    assert len(records) == 3 and len({r.config_hash for r in records}) == 3
    # Ray starts its workers at niceness 15; the trials' ranks run at the tuner's own
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    assert [r.result.environment.niceness for r in records] == [mine] * 3
    # one Ray experiment, the baseline first and then the Optuna search's trials (one actor, one fork server)
    assert len(list((data_dir / "ray_results").iterdir())) == 1
    assert not any("niceness" in n for r in records for n in r.result.notes)
    assert all(r.result.others_busy is None for r in records)  # --settle 0: the machine's load not looked at
    import optuna  # the sampler's study lives in the same database

    def screens():
        study = optuna.load_study(study_name=first["study_name"], storage=db)
        return study, [t.params for t in study.trials if t.system_attrs.get("advisor_screen")]

    # the baseline runs first, outside Optuna, and enters Optuna's study as the screen's reference;
    # a budget of 3 screens one knob, then the other from the better of the two: precision first, or batch size
    # where the baseline measured overhead-bound (a verdict that a busy machine can tip; advisor/tune/screening.py)
    study, screened = screens()
    assert len(study.trials) == 3
    (ref,) = [t for t in study.trials if t.user_attrs.get("advisor_reference")]
    assert ref.params == {"batch_size": 8, "precision": "fp32"}
    assert ref.value == pytest.approx(first["baseline"]["samples_per_s"])
    knob, other = ("batch_size", "precision") if ref.user_attrs.get("advisor_bottleneck") == "overhead-bound" \
        else ("precision", "batch_size")
    first_screen = {**ref.params, knob: {"batch_size": 4, "precision": "bf16"}[knob]}
    assert screened[0] == first_screen and len(screened) == 2
    assert screened[1][other] == {"batch_size": 4, "precision": "bf16"}[other]
    again = run_tune(data_dir, db, "--trials", "3")  # same arguments: the same study, nothing to run
    assert again["study_id"] == first["study_id"] and again["stats"]["resumed_from"] == 3
    assert len(stored(db)) == 3
    # a bigger budget continues it: one new configuration (the wait for quiet is no part of the study)
    more = run_tune(data_dir, db, "--trials", "4", "--settle", "0.5")
    assert more["study_id"] == first["study_id"] and more["statuses"] == {"ok": 4}
    assert len({r.config_hash for r in stored(db)}) == 4
    (new,) = [r for r in stored(db) if r.result.others_busy is not None]  # it looked, before the new trial only
    assert 0 <= new.result.others_busy <= 1
    # the resumed study keeps its screens; the reference is not added twice
    study, screened = screens()
    assert screened[0] == first_screen
    assert any(t.params["batch_size"] == 4 for t in study.trials)
    assert sum(1 for t in study.trials if t.user_attrs.get("advisor_reference")) == 1


def test_an_inline_run_starts_no_ray_and_says_where_its_time_went(data_dir, capsys):
    from advisor.hardware import get_hardware
    from advisor.tune.driver import _inline
    from advisor.tune.render import summary_table
    from advisor.tune.request import TuneRequest
    from advisor.tune.summary import TuneSummary

    db = f"sqlite:///{data_dir / 'advisor.db'}"
    run = run_tune(data_dir, db, "--trials", "2")  # a CPU: the default executor runs the trials itself
    st = run["stats"]
    assert st["executor"] == "inline" and run["statuses"] == {"ok": 2} and st["trials_run"] == 2
    assert not (data_dir / "ray").exists() and not (data_dir / "ray_results").exists()  # no Ray was started
    assert "stop_s" not in st and min(st["start_s"], st["estimate_s"], run["trial_s"]) > 0
    assert st["start_s"] + st["estimate_s"] + run["trial_s"] <= run["wall_s"]
    summary_table(TuneSummary.model_validate(run))
    rest = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("the rest:"))
    assert "the search and the store" in rest and "Ray" not in rest
    # the search went on from the baseline's result as under Ray: one knob screened against it
    import optuna

    trials = optuna.load_study(study_name=run["study_name"], storage=db).trials
    (ref,) = [t.params for t in trials if t.user_attrs.get("advisor_reference")]
    (screen,) = [t.params for t in trials if t.system_attrs.get("advisor_screen")]
    assert ref == {"batch_size": 8, "precision": "fp32"} and sum(screen[k] != v for k, v in ref.items()) == 1
    # --time-budget stops starting trials: the first starts at once, and none after it
    timed = run_tune(data_dir, db, "--trials", "4", "--time-budget", "0.5", "--study", "timed", "--remeasure")
    assert timed["statuses"] == {"ok": 1} and timed["stats"]["stopped_because"] == "the time budget (0.5 s) is spent"
    # auto: Ray where trials run side by side (a GPU per trial on an 8-GPU node) or a cluster is named
    cpu, node = get_hardware("cpu"), get_hardware("h100-sxm:8")
    assert _inline(TuneRequest(workload="tiny-mlp"), cpu) and _inline(TuneRequest(workload="tiny-mlp"),
                                                                       get_hardware("h100-sxm"))
    assert not _inline(TuneRequest(workload="tiny-mlp"), node)
    assert not _inline(TuneRequest(workload="tiny-mlp", ray_address="auto"), cpu)
    assert _inline(TuneRequest(workload="tiny-mlp", executor="inline"), node)
    assert not _inline(TuneRequest(workload="tiny-mlp", executor="ray"), cpu)
    env = {**os.environ, "ADVISOR_DATA_DIR": str(data_dir)}
    bad = subprocess.run(tune_cmd(db, "--executor", "inline", "--ray-address", "auto"), capture_output=True,
                         text=True, env=env, timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "--executor" in bad.stderr


def test_a_new_study_reuses_measurements_within_its_budget(data_dir):
    db = f"sqlite:///{data_dir / 'advisor.db'}"
    # a budget past the 4-point grid: once every draw repeats a measured point, the run ends
    grid = run_tune(data_dir, db, "--trials", "6", "--sampler", "brute-force", "--study", "grid")
    assert grid["statuses"] == {"ok": 4} and grid["trial_s"] > 0 and grid["stats"]["trials_run"] == 4
    assert grid["stats"]["stopped_because"].endswith("the space is spent"), grid["stats"]
    replay = run_tune(data_dir, db, "--trials", "2", "--sampler", "random", "--study", "replay")
    # every configuration is reused from the grid study, and reused ones count towards the budget
    assert replay["statuses"] == {"ok": 2} and replay["trial_s"] == 0
    assert replay["stats"]["stopped_because"].startswith("ran the 2 trial(s)")
    # TPE alone on a 4-point grid repeats itself: each repeat is answered from what the run has, so every trial
    # run is a configuration of its own and the study reaches its budget
    tpe = run_tune(data_dir, db, "--trials", "4", "--sampler", "tpe-plain", "--study", "tpe", "--seed", "1")
    assert tpe["statuses"] == {"ok": 4} and tpe["stats"]["trials_run"] == 4, tpe["stats"]
    rows = [r for r in stored(db) if r.study_id != tpe["study_id"]]
    assert len(rows) == 6
    grid_results = {r.config_hash: r.samples_per_s for r in rows if r.study_id == grid["study_id"]}
    assert all(grid_results[r.config_hash] == r.samples_per_s for r in rows if r.study_id == replay["study_id"])
    # a space whose choices leave the baseline out (tiny-mlp's batch 8): the baseline is measured (here
    # reused) as the reference all the same, and only the space's points are drawn after it
    space = data_dir / "no-baseline.yaml"
    space.write_text("name: no-baseline\nknobs:\n  batch_size: {choices: [4, 16]}\n")
    apart = run_tune(data_dir, db, "--trials", "2", "--sampler", "brute-force", "--study", "apart",
                     "--space", str(space))
    assert apart["statuses"] == {"ok": 2} and apart["baseline"]["config"]["batch_size"] == 8
    drawn = [r.config.batch_size for r in stored(db) if r.study_id == apart["study_id"]]
    assert len(drawn) == 2 and drawn.count(8) == 1 and set(drawn) - {8} <= {4, 16}, drawn


def test_the_leaders_are_measured_again_and_the_best_is_the_best_mean(data_dir):
    """Two passes over a 3-point grid, their figures (the row's and its result's) then set so that batch 4's newer
    run is the lucky one: a study without confirmation names it best on that one run; with one trial kept to
    confirm, the tuner measures it again (reusing the older pass, not the copy it holds) and names batch 2, the
    better mean."""
    import optuna
    import sqlalchemy as sa

    from advisor.store.models import TrialRow

    db = f"sqlite:///{data_dir / 'advisor.db'}"
    space = data_dir / "batches.yaml"
    space.write_text("name: batches\nknobs:\n  batch_size: {choices: [2, 4, 8]}\n")
    grid = [run_tune(data_dir, db, "--trials", "3", "--sampler", "brute-force", "--study", f"grid{i}",
                     "--space", str(space), *(["--remeasure"] if i else [])) for i in range(2)]
    assert all(g["statuses"] == {"ok": 3} for g in grid)
    figures = {(0, 8): 50.0, (1, 8): 50.0, (0, 4): 80.0, (1, 4): 100.0, (0, 2): 99.0, (1, 2): 95.0}
    engine = sa.create_engine(db)
    with engine.begin() as conn:
        for row in conn.execute(sa.select(TrialRow.id, TrialRow.study_id, TrialRow.result)).all():
            study = next(i for i, g in enumerate(grid) if g["study_id"] == row.study_id)
            sps = figures[study, row.result["config"]["batch_size"]]
            conn.execute(sa.update(TrialRow).where(TrialRow.id == row.id)
                         .values(samples_per_s=sps, result={**row.result, "samples_per_s": sps}))
    engine.dispose()
    common = ("--trials", "3", "--sampler", "brute-force", "--space", str(space))
    once = run_tune(data_dir, db, *common, "--study", "once", "--confirm", "0")
    assert once["best"]["record"]["config"]["batch_size"] == 4 and once["best"]["value"] == 100.0
    # the budget ended the experiment on the last trial's result; Optuna's study has it all the same
    study = optuna.load_study(study_name=once["study_name"], storage=db)
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE] * 3
    confirmed = run_tune(data_dir, db, "--trials", "4", "--sampler", "brute-force", "--space", str(space),
                         "--study", "confirmed", "--confirm", "1")
    assert confirmed["stats"]["confirmed"] == 1 and confirmed["trial_s"] == 0  # nothing measured: all reused
    ranked = [(t["record"]["config"]["batch_size"], t["value"], t["measurements"]) for t in confirmed["top"]]
    assert ranked == [(2, 95.0, 1), (4, 90.0, 2), (8, 50.0, 1)]
    assert confirmed["best"]["speedup"] == pytest.approx(95.0 / 50.0)


def test_kill_9_then_resume_loses_and_repeats_nothing(data_dir):
    db = f"sqlite:///{data_dir / 'advisor.db'}"
    env = {**os.environ, "ADVISOR_DATA_DIR": str(data_dir)}
    args = ["--trials", "4", "--sampler", "brute-force", "--min-time", "1.5"]
    proc = subprocess.Popen(tune_cmd(db, *args), env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # kill it once a trial is stored and the next is running
        if data_dir.joinpath("advisor.db").exists():
            rows = stored(db)
            if any(r.status.value == "ok" for r in rows) and any(r.status.value == "running" for r in rows):
                break
        time.sleep(0.2)
    else:
        proc.kill()
        pytest.fail("the tuner never had a trial running after a finished one")
    done_before = {r.config_hash: r.id for r in stored(db) if r.status.value == "ok"}
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    summary = run_tune(data_dir, db, *args)
    rows = stored(db)
    assert summary["stats"]["interrupted"] >= 1  # the trial in flight was marked, then retried
    for config_hash, row_id in done_before.items():  # finished trials kept, never measured again
        assert [r.id for r in rows if r.config_hash == config_hash] == [row_id]
    ok = Counter(r.config_hash for r in rows if r.status.value == "ok")
    assert len(ok) == 4 and set(ok.values()) == {1}  # every configuration measured exactly once
    retried = [r for r in rows if r.attempt == 2]
    assert retried and all(r.status.value == "ok" for r in retried)


def test_a_configuration_that_crashes_does_not_stop_the_study(data_dir, tmp_path):
    db = f"sqlite:///{data_dir / 'advisor.db'}"
    summary = run_tune(data_dir, db, "--trials", "4", "--sampler", "brute-force", "-a", f"out_dir={tmp_path}",
                       "-a", "fail=abort-on-bf16", "--executor", "ray", workload=RECORDER)
    assert summary["statuses"] == {"ok": 2, "crashed": 2}
    crashed = [r for r in stored(db) if r.status.value == "crashed"]
    assert {r.config.precision.value for r in crashed} == {"bf16"} and all("SIGABRT" in r.error for r in crashed)
    # under Ray, every trial's rank was forked by the tuner's own trial fork server, not one its Ray actor
    # started (the log's other steps are the fresh processes of the protocol's peak runs, which set no RANK)
    tuner = {int(r.owner.rsplit(":", 1)[1]) for r in stored(db)}
    steps = [json.loads(line) for line in (tmp_path / "log-abort-on-bf16.jsonl").read_text().splitlines()]
    ranks = [s for s in steps if s["rank"] is not None]
    assert len(tuner) == 1 and len({s["pid"] for s in ranks}) == 4 and {s["server_parent"] for s in ranks} == tuner


def test_two_tuners_on_one_postgresql_study_never_measure_a_config_twice(data_dir, postgresql_url):
    env = {**os.environ, "ADVISOR_DATA_DIR": str(data_dir)}
    args = ["--trials", "4", "--sampler", "brute-force", "--study", "shared"]
    procs = [subprocess.Popen(tune_cmd(postgresql_url, *args), env={**env, "ADVISOR_DATA_DIR": str(data_dir / str(i))},
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        # the budget is the study's: a configuration the other tuner measured meanwhile counts towards it, so
        # each tuner stops once the study holds 4, without drawing the spent grid again and again
        stats = json.loads(out)["stats"]
        assert stats["stopped_because"].startswith("ran the 4 trial(s)") and stats["trials_run"] <= 6, stats
    rows = stored(postgresql_url)
    measured = [r for r in rows if r.status.value in ("ok", "oom", "crashed", "error", "timeout")]
    assert Counter(r.config_hash for r in measured).most_common(1)[0][1] == 1  # none twice
    assert len({r.config_hash for r in measured}) == 4
    assert len({r.owner for r in measured}) >= 1


def test_a_corrupted_store_is_one_clear_line(data_dir):
    bad = data_dir / "bad.db"
    bad.write_bytes(b"this is not a database" * 100)
    env = {**os.environ, "ADVISOR_DATA_DIR": str(data_dir)}
    proc = subprocess.run(tune_cmd(f"sqlite:///{bad}", "--trials", "1"), capture_output=True, text=True, env=env,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "bad.db" in lines[0] and "Traceback" not in proc.stderr
