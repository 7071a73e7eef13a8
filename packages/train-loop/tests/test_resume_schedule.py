"""A resumed run's lr never surprises: resumed with the same total it is the uninterrupted run's
at every step; resumed with another total, a cosine schedule refuses in one line naming the jump
(unless `training.on_extend` says keep or recompute) and a wsd schedule extended in its stable
phase goes on at the same lr. Real `llmtrain run`s of a tiny model, in this process."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from llmtrain.train_loop.schedules import WarmupOptions, WSDOptions, cosine, wsd

LR = 1e-3


@pytest.fixture
def write_config(tiny_run_config: Callable[..., Path]) -> Callable[[dict[str, Any]], Path]:
    """A 12-step run config with the lr schedule `schedule`, a checkpoint every 6 steps."""

    def write(schedule: dict[str, Any]) -> Path:
        training = {"steps": 12, "log_every": 1, "checkpoint_every": 6}
        return tiny_run_config(optimizer={"lr": LR}, lr_scheduler=schedule, training=training)

    return write


def lrs(tmp_path: Path) -> dict[int, float]:
    """The lr logged at each step (the last line of a step logged twice)."""
    lines = (tmp_path / "runs" / "r" / "metrics.jsonl").read_text().splitlines()
    return {m["step"]: m["lr"] for m in map(json.loads, lines)}


def back_to_step_6(tmp_path: Path) -> None:
    shutil.rmtree(tmp_path / "runs" / "r" / "checkpoints" / "step-12")


def error_line(code: int, err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1, err
    return lines[0]


COSINE = {"kind": "cosine", "warmup_steps": 2, "min_ratio": 0.1}


def test_a_resumed_run_has_the_uninterrupted_runs_lr_at_every_step(run_cli, write_config, tmp_path):
    path = write_config(COSINE)
    code, _, err = run_cli("run", path)
    assert code == 0, err
    whole = lrs(tmp_path)
    schedule = cosine(WarmupOptions(warmup_steps=2, min_ratio=0.1), 12)
    assert whole == pytest.approx({s: LR * schedule(s - 1) for s in range(1, 13)}, rel=1e-12)

    back_to_step_6(tmp_path)
    code, _, err = run_cli("run", path)
    assert code == 0, err
    assert "run.resumed" in err and "lr.schedule" not in err
    assert lrs(tmp_path) == whole  # steps 7..12 again, the same lr exactly


def test_an_extended_cosine_run_refuses_naming_the_jump_then_keeps_or_recomputes(
    run_cli, write_config, tmp_path
):
    path = write_config(COSINE)
    code, _, err = run_cli("run", path)
    assert code == 0, err
    whole = lrs(tmp_path)
    final = LR * 0.1  # past its end the trained schedule stays at min_ratio x lr
    recomputed = cosine(WarmupOptions(warmup_steps=2, min_ratio=0.1), 24)

    code, out, err = run_cli("run", path, "training.steps=24")
    assert out == ""
    line = error_line(code, err)
    assert line == (
        "error: training.steps: checkpoint step 12 was trained on a cosine lr schedule over 12 "
        f"steps; a cosine lr schedule over 24 steps moves the lr at step 13 from {final:.2e} to "
        f"{LR * recomputed(12):.2e}. Set training.on_extend=keep to go on with the trained "
        f"schedule ({final:.2e} at step 13) or training.on_extend=recompute to take the jump; "
        "a wsd schedule extends without one from a checkpoint before its decay"
    )
    assert lrs(tmp_path) == whole  # nothing trained

    # keep: 6 more steps at the trained schedule's final lr; a second keep goes on with it
    code, _, err = run_cli("run", path, "training.steps=18", "training.on_extend=keep")
    assert code == 0, err
    assert (
        "training.on_extend=keep: going on with the trained schedule, a cosine lr schedule over 12"
        in err
    )
    kept = lrs(tmp_path)
    assert [kept[s] for s in range(13, 19)] == pytest.approx([final] * 6, rel=1e-12)
    code, _, err = run_cli("run", path, "training.steps=24", "training.on_extend=keep")
    assert code == 0, err
    assert [lrs(tmp_path)[s] for s in range(19, 25)] == pytest.approx([final] * 6, rel=1e-12)

    # recompute: the configured schedule, jump and all, said in the log
    code, _, err = run_cli("run", path, "training.steps=30", "training.on_extend=recompute")
    assert code == 0, err
    again = cosine(WarmupOptions(warmup_steps=2, min_ratio=0.1), 30)
    assert f"the lr jumps at step 25 from {final:.2e} to {LR * again(24):.2e}" in err
    assert lrs(tmp_path)[25] == pytest.approx(LR * again(24), rel=1e-12)


def test_an_extended_wsd_run_keeps_its_lr_continuous(run_cli, write_config, tmp_path):
    schedule = {"kind": "wsd", "warmup_steps": 2, "decay_fraction": 0.25}
    path = write_config(schedule)
    code, _, err = run_cli("run", path)
    assert code == 0, err
    assert lrs(tmp_path)[12] == pytest.approx(LR / 3, rel=1e-12)  # decays over steps 10..12

    # finished and decayed: extending moves the lr back up, refused like a cosine run
    code, _, err = run_cli("run", path, "training.steps=24")
    assert "from 0.00e+00 to 1.00e-03" in error_line(code, err)

    # from step 6, in the stable phase: 24 steps go on at the same lr and decay at the new end
    back_to_step_6(tmp_path)
    code, _, err = run_cli("run", path, "training.steps=24")
    assert code == 0, err
    assert "the lr at step 7 stays 1.00e-03; it decays from step 19" in err
    got = lrs(tmp_path)
    extended = wsd(WSDOptions(warmup_steps=2, decay_fraction=0.25), 24)
    assert got == pytest.approx({s: LR * extended(s - 1) for s in range(1, 25)}, abs=1e-15)
    assert [got[s] for s in range(3, 19)] == [LR] * 16  # no jump at step 7: flat until 18


def test_wsd_decay_steps_extend_by_a_fixed_decay(run_cli, write_config, tmp_path):
    schedule = {"kind": "wsd", "decay_steps": 4}
    path = write_config(schedule)
    code, _, err = run_cli("run", path)
    assert code == 0, err
    back_to_step_6(tmp_path)
    code, _, err = run_cli("run", path, "training.steps=20")
    assert code == 0, err
    got = lrs(tmp_path)
    assert [got[s] for s in range(1, 17)] == [LR] * 16
    assert [got[s] for s in range(17, 21)] == pytest.approx([LR * f for f in (1, 0.75, 0.5, 0.25)])
