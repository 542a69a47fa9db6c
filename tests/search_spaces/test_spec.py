"""Loading and validating spaces: the shipped presets, a user's YAML, and --fix overrides."""

from __future__ import annotations

from pathlib import Path

import pytest

from advisor.errors import SpecError
from search_spaces import SPACES, Choices, Fixed, IntRange, apply_fixes, get_space, grid, load_space, parse_fixes
from search_spaces.sample import Plan
from search_spaces.spec import KNOBS


@pytest.mark.parametrize("name", ["quick", "default", "exhaustive", "tiny"])
def test_every_preset_loads_by_name_and_by_path(name):
    space = get_space(name)
    assert space.name == name
    assert Path(str(SPACES[name])).is_file()  # shipped inside the package (package data)
    assert load_space(str(SPACES[name])) == space
    assert space.conditions, "presets carry their conditions as data"


def test_quick_searches_batch_workers_precision_only():
    space = get_space("quick")
    assert set(space.knobs) == {"batch_size", "num_workers", "precision"}
    assert isinstance(space.knobs["batch_size"], IntRange) and space.knobs["batch_size"].powers_of_two


def test_unknown_space_lists_the_valid_names():
    with pytest.raises(SpecError, match="quick, default, exhaustive, tiny"):
        get_space("fastest")


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "space.yaml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("text, field, allowed", [
    ("name: x\nknobs:\n  precision: {choices: [fp32, bf17]}\n", "precision", "fp32, tf32, bf16, fp16, bf16-pure"),
    ("name: x\nknobs:\n  num_workers: {choices: [-1]}\n", "num_workers", "an integer >= 0"),
    ("name: x\nknobs:\n  batch_size: {low: 8, high: 4}\n", "batch_size", "low 8 is above high 4"),
    ("name: x\nknobs:\n  batch_size: {low: 1, high: 64, log: true, step: 2}\n", "batch_size", "log and step"),
    ("name: x\nknobs:\n  batch_size: {low: 1, high: gpu_memory}\n", "batch_size", "default_batch_size"),
    ("name: x\nknobs:\n  precision: {low: 1, high: 2}\n", "precision", "integer knobs: batch_size"),
    ("name: x\nknobs:\n  nproc: {fixed: 2}\n", "nproc", "nproc follows strategy"),
    ("name: x\nknobs:\n  batch_size: {low: 1, high: 8, lg: true}\n", "batch_size.lg",
     "unknown field; allowed: low, high, step, log, powers_of_two"),
    ("name: x\nknob:\n  precision: {fixed: fp32}\n", "knob", "allowed: name, description, knobs, conditions"),
    ("name: x\nconditions:\n  - {knob: strategy, when: {precision: fp32}}\n", "conditions.0", "decided before"),
    ("name: x\nconditions:\n  - {knob: precision, values: [fp16], when: {num_workers: 0}}\n", "conditions.0",
     "target facts only"),
    ("name: x\nconditions:\n  - {knob: precision, when: {gpu: true}}\n", "conditions.0", "facts: device, device_count"),
    ("name: x\nconditions:\n  - {knob: precision, when: {device: {greater: 1}}}\n", "conditions.0", "use eq, ne"),
    ("name: x\nconditions:\n  - {knob: precision, when: {strategy: singel}}\n", "conditions.0",
     "allowed: single, ddp, zero1, zero2, zero3"),
    ("name: x\nconditions:\n  - {knob: precision, when: {device: gpu}}\n", "conditions.0", "allowed: cpu, cuda"),
    ("name: x\nknobs:\n  batch_size: {choices: [true]}\n", "batch_size", "an integer >= 1"),
    ("name: x\nconditions:\n  - {knob: compile_mode, when: {device: cuda}, advisory: true}\n", "conditions.0",
     "`advisory` belongs to a condition with `values`"),
])
def test_a_bad_space_names_the_field_and_what_is_allowed(tmp_path, text, field, allowed):
    with pytest.raises(SpecError) as info:
        load_space(_write(tmp_path, text))
    message = str(info.value)
    assert "space.yaml" in message and field in message and allowed in message, message


def test_not_yaml_or_not_a_mapping(tmp_path):
    with pytest.raises(SpecError, match="not valid YAML"):
        load_space(_write(tmp_path, "name: [x\n"))
    with pytest.raises(SpecError, match="expected a mapping"):
        load_space(_write(tmp_path, "- quick\n"))
    with pytest.raises(SpecError, match="does not exist"):
        load_space(str(tmp_path / "missing.yaml"))


def test_values_are_normalized_to_plain_form(tmp_path):
    space = load_space(_write(tmp_path, "name: x\nknobs:\n  compile_mode: {choices: [none, max-autotune]}\n"
                                        "  optimizer_impl: {choices: [null, fused]}\n"))
    assert space.knobs["compile_mode"] == Choices(choices=["none", "max-autotune"])
    assert space.knobs["optimizer_impl"] == Choices(choices=[None, "fused"])


def test_checkpointing_takes_its_modes_and_the_booleans(tmp_path, cpu_ctx):
    space = load_space(_write(tmp_path, "name: x\nknobs:\n  checkpointing: {choices: [false, selective, true]}\n"
                                        "  channels_last: {choices: [false, true]}\nconditions:\n"
                                        "  - {knob: channels_last, when: {checkpointing: true}}\n"))
    assert space.knobs["checkpointing"] == Choices(choices=["none", "selective", "full"])
    configs = grid(space, cpu_ctx)
    assert sorted((c.checkpointing.value, c.channels_last) for c in configs) == [  # `when: true` tests full
        ("full", False), ("full", True), ("none", False), ("selective", False)]
    fixed = apply_fixes(space, parse_fixes(["checkpointing=true"]))
    assert {c.checkpointing.value for c in grid(fixed, cpu_ctx)} == {"full"}
    assert Plan(get_space("exhaustive"), cpu_ctx).domain("checkpointing").values == ("none", "selective", "full")
    with pytest.raises(SpecError, match="partial.*allowed: none, selective, full"):
        apply_fixes(space, {"checkpointing": "partial"})


def test_parse_fixes_reads_yaml_scalars():
    assert parse_fixes(["precision=bf16", "num_workers=4", "pin_memory=true", "prefetch_factor=null",
                        "compile_mode=none"]) == {
        "precision": "bf16", "num_workers": 4, "pin_memory": True, "prefetch_factor": None, "compile_mode": "none"}
    with pytest.raises(SpecError, match="not knob=value"):
        parse_fixes(["precision"])


def test_apply_fixes_pins_a_knob(gpu_ctx):
    space = apply_fixes(get_space("tiny"), {"precision": "bf16", "num_workers": 1})
    assert space.knobs["precision"] == Fixed(fixed="bf16")
    configs = grid(space, gpu_ctx)
    assert configs and {c.precision.value for c in configs} == {"bf16"}
    assert {c.num_workers for c in configs} == {1}
    assert len(configs) == len(grid(get_space("tiny"), gpu_ctx)) // 6  # 3 precisions x 2 worker counts


def test_a_bad_fix_names_the_allowed_knobs_or_values():
    with pytest.raises(SpecError) as info:
        apply_fixes(get_space("tiny"), {"precison": "bf16"})
    assert "precison" in str(info.value) and all(k in str(info.value) for k in KNOBS)
    with pytest.raises(SpecError, match="bf17.*allowed: fp32, tf32, bf16, fp16, bf16-pure"):
        apply_fixes(get_space("tiny"), {"precision": "bf17"})
    with pytest.raises(SpecError, match="an integer >= 0"):
        apply_fixes(get_space("tiny"), {"num_workers": "many"})


def test_a_fix_the_target_excludes_says_why(cpu_ctx):
    space = apply_fixes(get_space("default"), {"precision": "fp16"})
    fp16_on_cpu = r"precision: no value .*\(fp16: fp16 autocast with a grad scaler is a GPU path\)"
    with pytest.raises(SpecError, match=fp16_on_cpu):
        grid(space, cpu_ctx)
