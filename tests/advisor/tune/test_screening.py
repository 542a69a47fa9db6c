"""The screening sampler on real Optuna studies: one knob changed per screen in impact order (the baseline's
bottleneck first), the pairs known to interact after both of their knobs, each screen from the best configuration
measured so far, each change once more where that has moved since, then the base sampler; a resumed study does
not screen again.

The objective here is a formula of the knobs (not a measurement) so each case has one right
answer; the end-to-end path, inline and through Ray, with real trials is in test_tune.py.
"""

from __future__ import annotations

import warnings

import optuna
import pytest

from advisor.tune.screening import ROLE_ATTR, ScreeningSampler, add_reference, farthest

optuna.logging.set_verbosity(optuna.logging.WARNING)
REFERENCE = {"batch_size": 8, "num_workers": 0, "precision": "fp32", "compile_mode": "none", "threads": None}


def space(trial) -> dict:
    """A define-by-run space like the tuner's: prefetch_factor exists only with workers."""
    p = {"batch_size": trial.suggest_categorical("batch_size", [2, 8, 32]),
         "num_workers": trial.suggest_int("num_workers", 0, 4)}
    if p["num_workers"] > 0:
        p["prefetch_factor"] = trial.suggest_categorical("prefetch_factor", [1, 2, 4])
    p.update(precision=trial.suggest_categorical("precision", ["fp32", "bf16"]),
             compile_mode=trial.suggest_categorical("compile_mode", ["none", "default"]),
             threads=trial.suggest_categorical("threads", [None, 1]))
    return p


def throughput(p: dict) -> float:
    """bf16 and workers help, compile helps a little, batch 32 and one thread hurt."""
    v = 100.0 * {2: 0.95, 8: 1.0, 32: 0.8}[p["batch_size"]]
    v *= 1.3 if p["precision"] == "bf16" else 1.0
    v *= 1.5 if p["num_workers"] else 1.0
    v *= 1.05 if p["compile_mode"] == "default" else 1.0
    return v * (0.6 if p["threads"] == 1 else 1.0)


def new_study(max_screens: int = 10, storage=None, name: str | None = None,
              bottleneck: str | None = None) -> optuna.Study:
    sampler = ScreeningSampler(optuna.samplers.TPESampler(seed=0, n_startup_trials=2), max_screens=max_screens)
    study = optuna.create_study(direction="maximize", sampler=sampler, storage=storage, study_name=name,
                                load_if_exists=True)
    fixed = optuna.trial.FixedTrial(REFERENCE)
    add_reference(study, fixed.params, fixed.distributions, [throughput(space(fixed))], bottleneck=bottleneck)
    return study


def run(study: optuna.Study, n: int) -> list[tuple[str | None, dict]]:
    out = []
    for _ in range(n):
        trial = study.ask()
        params = space(trial)
        study.tell(trial, throughput(params))
        out.append((study.trials[-1].system_attrs.get(ROLE_ATTR), params))
    return out


def changed(params: dict) -> dict:
    return {k: v for k, v in params.items() if k in REFERENCE and REFERENCE[k] != v}


def test_screens_each_knob_and_pair_from_the_best_so_far_then_hands_over():
    steps = run(new_study(), 8)
    roles = [role for role, _ in steps]
    # impact order: precision, compile, batch size, workers, threads, each to its farthest other value; a pair of
    # INTERACTIONS after its second knob, skipped where it is a configuration measured already (bf16 and compile
    # both won, so their pair is the compile screen)
    assert roles[:6] == ["precision='bf16'", "compile_mode='default'", "batch_size=32", "num_workers=4",
                         "precision='bf16',batch_size=32", "threads=1"]
    # each from the best so far: bf16 won, so compile is screened under bf16, and so on; the pair of bf16 and
    # batch 32 comes after workers won, so it tries batch 32 again beside them
    assert [changed(p) for _, p in steps[:6]] == [
        {"precision": "bf16"}, {"precision": "bf16", "compile_mode": "default"},
        {"precision": "bf16", "compile_mode": "default", "batch_size": 32},
        {"precision": "bf16", "compile_mode": "default", "num_workers": 4},
        {"precision": "bf16", "compile_mode": "default", "num_workers": 4, "batch_size": 32},
        {"precision": "bf16", "compile_mode": "default", "num_workers": 4, "threads": 1}]
    assert steps[3][1]["prefetch_factor"] == 2  # the knob workers opened takes PyTorch's default
    assert roles[6:] == [None, None]  # every change measured from the incumbent: TPE from here on


def test_a_pair_that_wins_where_each_knob_alone_loses_is_found_and_kept():
    """bf16 alone and compile alone each lose to fp32 eager; together they win (autocast's casts fused)."""
    def world(p: dict) -> float:
        bf16, compiled = p["precision"] == "bf16", p["compile_mode"] == "default"
        return 100.0 * (1.2 if bf16 and compiled else 0.8 if bf16 or compiled else 1.0) * (0.9 if p["threads"] else 1)

    study = new_study(max_screens=4)
    for _ in range(5):
        trial = study.ask()
        study.tell(trial, world(space(trial)))
    best = study.best_trial
    assert best.params["precision"] == "bf16" and best.params["compile_mode"] == "default"
    assert best.system_attrs.get(ROLE_ATTR) == "precision='bf16',compile_mode='default'"


def test_a_pair_that_lost_is_screened_again_once_a_later_knob_won():
    """One thread loses beside the intra-op pool and wins once two workers decode the batches beside it, but only
    under bf16 (an image model on a CPU): from fp32 the pair loses; once bf16 has won, the pair is screened again
    from the incumbent and wins."""
    def world(p: dict) -> float:
        bf16, fed, one = p["precision"] == "bf16", p["num_workers"] > 0, p["threads"] == 1
        return 100.0 * (1.3 if bf16 else 1.0) * (1.05 if fed else 1.0) * \
            ((1.25 if bf16 and fed else 0.6) if one else 1.0)

    study = new_study(bottleneck="input-bound")
    roles = []
    for _ in range(4):
        trial = study.ask()
        study.tell(trial, world(space(trial)))
        roles.append(study.trials[-1].system_attrs.get(ROLE_ATTR))
    # workers win alone; one thread beside them loses under fp32 (the pair is that same screen); bf16 wins; then
    # the pair again, from the incumbent that has bf16
    assert roles == ["num_workers=4", "threads=1", "precision='bf16'", "num_workers=4,threads=1"]
    best = study.best_trial
    assert (best.params["precision"], best.params["num_workers"] > 0, best.params["threads"]) == ("bf16", True, 1)


def test_a_change_is_screened_once_more_where_the_incumbent_moved_since():
    """Batch 32 loses while one process decodes and wins once workers feed it (no pair of the two is listed):
    once every knob is screened, it is tried again from the incumbent that has the workers."""
    def world(p: dict) -> float:
        fed = p["num_workers"] > 0
        return 100.0 * (1.5 if fed else 1.0) * ({2: 0.9, 8: 1.0, 32: 1.4 if fed else 0.7}[p["batch_size"]])

    study = new_study(max_screens=20)
    for _ in range(12):
        trial = study.ask()
        study.tell(trial, world(space(trial)))
    best = study.best_trial
    assert best.params["batch_size"] == 32 and best.params["num_workers"] == 4
    assert best.system_attrs.get(ROLE_ATTR) in ("again:batch_size=32", "precision='bf16',batch_size=32")


def test_an_input_bound_baseline_screens_the_input_pipeline_first():
    roles = [role for role, _ in run(new_study(bottleneck="input-bound"), 3)]
    assert roles == ["num_workers=4", "threads=1", "precision='bf16'"]


def test_max_screens_keeps_the_most_impactful_knobs():
    roles = [role for role, _ in run(new_study(max_screens=2), 3)]
    assert roles == ["precision='bf16'", "compile_mode='default'", None]  # two screens, then TPE


def test_a_resumed_study_does_not_screen_again(tmp_path):
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    run(new_study(storage=storage, name="s"), 3)
    again = new_study(storage=storage, name="s")  # a new sampler, as after a restart; reference not re-added
    assert sum(1 for t in again.trials if t.user_attrs.get("advisor_reference")) == 1
    roles = [role for role, _ in run(again, 3)]
    assert roles == ["num_workers=4", "precision='bf16',batch_size=32", "threads=1"]  # the first three were screened


def test_without_a_reference_the_base_sampler_decides():
    study = optuna.create_study(direction="maximize", sampler=ScreeningSampler(
        optuna.samplers.RandomSampler(seed=1), max_screens=5))
    assert [role for role, _ in run(study, 3)] == [None, None, None]


@pytest.mark.parametrize("choices,value,other", [([2, 8, 32], 8, 32), ([2, 8, 32], 32, 2), ([2, 8, 32, 64], 8, 64),
                                                 (["none", "default"], "none", "default"), ([1], 1, None)])
def test_farthest_level(choices, value, other):
    assert farthest(optuna.distributions.CategoricalDistribution(choices), value) == other


def test_farthest_in_an_int_range():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dist = optuna.distributions.IntDistribution(0, 6)
    assert farthest(dist, 0) == 6 and farthest(dist, 5) == 0
    assert farthest(optuna.distributions.IntDistribution(3, 3), 3) is None


def test_a_screen_that_failed_is_not_tried_again():
    study = new_study()
    trial = study.ask()
    space(trial)
    study.tell(trial, state=optuna.trial.TrialState.FAIL)  # e.g. the Ray worker died under it
    assert [role for role, _ in run(study, 1)] == ["compile_mode='default'"]


def test_a_trial_just_asked_by_another_live_tuner_is_not_failed_as_stale(tmp_path):
    """`_fail_stale` on a real Optuna RDB study: a dead owner's trial and an ownerless one older than
    the grace become FAIL; a live owner's, and one just asked (no owner yet), stay RUNNING."""
    import os
    import socket
    import subprocess
    import sys

    import sqlalchemy

    from advisor.tune.driver import OWNERLESS_GRACE_S, _fail_stale

    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    storage = optuna.storages.RDBStorage(url)
    study = optuna.create_study(storage=storage, study_name="s")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    trials = {name: study.ask() for name in ("just asked", "old", "live", "dead")}
    trials["live"].set_user_attr("owner", f"{socket.gethostname()}:{os.getpid()}")
    trials["dead"].set_user_attr("owner", f"{socket.gethostname()}:{int(dead.stdout)}")
    with sqlalchemy.create_engine(url).begin() as conn:  # asked before the grace began
        conn.execute(sqlalchemy.text("UPDATE trials SET datetime_start = datetime(datetime_start, :ago) "
                                     "WHERE number = :n"),
                     {"ago": f"-{int(OWNERLESS_GRACE_S) + 60} seconds", "n": trials["old"].number})
    assert _fail_stale(storage, "s") == 2
    state = {name: storage.get_trial(t._trial_id).state for name, t in trials.items()}
    running, fail = optuna.trial.TrialState.RUNNING, optuna.trial.TrialState.FAIL
    assert state == {"just asked": running, "old": fail, "live": running, "dead": fail}
