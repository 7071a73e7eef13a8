"""lr schedules: the multiplier of the base lr at known (0-based) steps, exactly."""

from __future__ import annotations

import itertools
import math

import pytest

from llmtrain.train_loop.schedules import (
    WarmupOptions,
    WSDOptions,
    constant,
    cosine,
    decay_start,
    linear,
    schedule_change,
    wsd,
)


def values(schedule, steps) -> list[float]:
    return [schedule(step) for step in steps]


def test_constant_warms_up_linearly_to_one_then_stays():
    factor = constant(WarmupOptions(warmup_steps=4), total_steps=100)
    assert values(factor, range(6)) == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert factor(99) == factor(500) == 1.0


def test_no_warmup_starts_at_full_lr():
    for build in (constant, cosine, linear):
        assert build(WarmupOptions(), total_steps=10)(0) == 1.0
    assert wsd(WSDOptions(), total_steps=10)(0) == 1.0


def test_cosine_decays_from_one_to_min_ratio():
    factor = cosine(WarmupOptions(warmup_steps=10, min_ratio=0.1), total_steps=110)
    assert values(factor, [0, 4, 9]) == pytest.approx([0.1, 0.5, 1.0], abs=1e-15)
    assert factor(10) == 1.0  # decay starts after warmup, at progress 0
    assert factor(35) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)), abs=1e-15)
    assert factor(60) == pytest.approx(0.55, abs=1e-15)  # half way: the mean of 1 and 0.1
    assert factor(110) == pytest.approx(0.1, abs=1e-15)
    assert factor(1000) == pytest.approx(0.1, abs=1e-15)  # past the end it stays at the floor
    decay = values(factor, range(10, 111))
    assert all(a > b for a, b in itertools.pairwise(decay))


def test_linear_decays_in_equal_steps():
    factor = linear(WarmupOptions(warmup_steps=2, min_ratio=0.0), total_steps=12)
    assert values(factor, range(13)) == pytest.approx(
        [0.5, 1.0, 1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.0], abs=1e-15
    )
    floor = linear(WarmupOptions(min_ratio=0.2), total_steps=10)
    assert floor(5) == pytest.approx(0.6, abs=1e-15)
    assert floor(10) == pytest.approx(0.2, abs=1e-15)


def test_wsd_is_flat_then_decays_over_the_last_fraction():
    factor = wsd(WSDOptions(warmup_steps=5, decay_fraction=0.2), total_steps=100)
    assert values(factor, range(5)) == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0], abs=1e-15)
    assert set(values(factor, range(5, 81))) == {1.0}  # stable until the decay starts at 80
    assert values(factor, [85, 90, 95, 99, 100]) == pytest.approx(
        [0.75, 0.5, 0.25, 0.05, 0.0], abs=1e-15
    )


@pytest.mark.parametrize(
    ("decay", "quarter", "half"),
    [
        ("linear", 0.75, 0.5),
        ("cosine", 0.5 * (1 + math.cos(math.pi / 4)), 0.5),
        ("sqrt", 0.5, 1 - math.sqrt(0.5)),
    ],
)
def test_wsd_decay_shapes_and_floor(decay, quarter, half):
    options = WSDOptions(decay_fraction=0.4, decay=decay, min_ratio=0.1)
    factor = wsd(options, total_steps=50)  # decays over steps 30..50
    assert factor(29) == 1.0
    assert factor(35) == pytest.approx(0.1 + 0.9 * quarter, abs=1e-15)
    assert factor(40) == pytest.approx(0.1 + 0.9 * half, abs=1e-15)
    assert factor(50) == pytest.approx(0.1, abs=1e-15)


def test_wsd_without_decay_stays_flat():
    factor = wsd(WSDOptions(decay_fraction=0.0), total_steps=20)
    assert set(values(factor, range(25))) == {1.0}


@pytest.mark.parametrize(
    ("options", "kwargs", "message"),
    [
        (WarmupOptions, {"min_ratio": 1.5}, "must be in [0, 1], got 1.5"),
        (WarmupOptions, {"warmup_steps": -1}, "must be at least 0, got -1"),
        (WSDOptions, {"decay": "exponential"}, "'decay' must be in"),
        (WSDOptions, {"decay_fraction": 1.2}, "must be in [0, 1], got 1.2"),
    ],
)
def test_bad_options_are_rejected(options, kwargs, message):
    with pytest.raises(ValueError) as info:
        options(**kwargs)
    assert message in str(info.value)


def test_registered_as_plugins(installed):
    registry = installed.registry("lr_scheduler")
    assert registry.names() == ["constant", "cosine", "linear", "wsd"]
    cosine_entry = registry.get("cosine")
    factor = cosine_entry.target(cosine_entry.options(warmup_steps=2, min_ratio=0.0), 10)
    assert values(factor, [0, 1, 6, 10]) == pytest.approx([0.5, 1.0, 0.5, 0.0], abs=1e-15)


def test_wsd_decay_steps_fix_the_decay_length_whatever_the_total():
    options = WSDOptions(decay_steps=4, decay_fraction=0.5)  # decay_steps wins over the fraction
    for total in (10, 40):
        factor = wsd(options, total_steps=total)
        assert factor(total - 5) == 1.0
        assert values(factor, range(total - 4, total + 1)) == pytest.approx(
            [1.0, 0.75, 0.5, 0.25, 0.0], abs=1e-15
        )
    assert decay_start(options, 40) == 36
    assert decay_start(WSDOptions(decay_fraction=0.25), 24) == 18
    assert decay_start(WarmupOptions(), 24) is None
    assert wsd(WSDOptions(decay_steps=50), total_steps=10)(0) == 1.0  # the decay is the run


def test_a_schedule_change_is_the_lr_at_the_resume_step_on_each():
    trained = cosine(WarmupOptions(warmup_steps=30, min_ratio=0.1), 600)
    longer = cosine(WarmupOptions(warmup_steps=30, min_ratio=0.1), 1200)
    change = schedule_change(trained, longer, 600, 3e-3)
    assert change.trained == pytest.approx(3e-4, rel=1e-12)  # past its end: the floor
    assert change.configured == pytest.approx(3e-3 * longer(600), rel=1e-12)
    assert change.jumps
    stable = wsd(WSDOptions(decay_fraction=0.2), 600)
    assert not schedule_change(stable, wsd(WSDOptions(decay_fraction=0.2), 1200), 400, 1e-3).jumps
    assert schedule_change(stable, wsd(WSDOptions(decay_fraction=0.2), 1200), 600, 1e-3).jumps
