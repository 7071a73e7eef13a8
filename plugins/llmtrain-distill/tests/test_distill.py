"""The `distill` objective: its loss against a hand computation, alpha=1 against the
`cross_entropy` objective, and a student trained through `llmtrain run` that moves towards its
teacher; a teacher that is not there is one error line."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import train_support as ts
from llmtrain_distill.objective import Distill
from llmtrain_distill.plugin import DistillOptions

from llmtrain.core_mesh.errors import UserError
from llmtrain.core_mesh.interfaces import ObjectiveContext
from llmtrain.train_loop.loss import IGNORE, cross_entropy_sum


def random_batch(seed: int, vocab: int = 13):
    gen = torch.Generator().manual_seed(seed)
    student = torch.randn(3, 6, vocab, generator=gen) * 2
    teacher = torch.randn(3, 6, vocab, generator=gen) * 2
    targets = torch.randint(0, vocab, (3, 6), generator=gen)
    targets[0, :4] = IGNORE
    targets[2, -1] = IGNORE
    return student, teacher, targets


def by_hand(student, teacher, targets, alpha, t):
    total = torch.zeros((), dtype=torch.float64)
    for s, te, y in zip(
        student.flatten(0, 1), teacher.flatten(0, 1), targets.flatten(), strict=True
    ):
        if y == IGNORE:
            continue
        ce = -F.log_softmax(s.double(), -1)[y]
        p = F.softmax(te.double() / t, -1)
        kl = (p * (p.log() - F.log_softmax(s.double() / t, -1))).sum()
        total += alpha * ce + (1 - alpha) * t * t * kl
    return total


def objective(**options) -> Distill:
    return Distill(None, DistillOptions(teacher="unused", **options))


@pytest.mark.parametrize(("alpha", "temperature"), [(0.0, 1.0), (0.3, 2.0), (0.9, 0.5)])
def test_the_loss_is_the_hand_computation(alpha, temperature):
    student, teacher, targets = random_batch(int(alpha * 10))
    loss = objective(alpha=alpha, temperature=temperature).loss(student, teacher, targets)
    expected = by_hand(student, teacher, targets, alpha, temperature)
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-5)


def test_metrics_are_recorded_means_per_counted_target_and_restart_each_step():
    from llmtrain.train_loop.metrics import MetricRecorder, combine_over

    student, teacher, targets = random_batch(5)
    recorder = MetricRecorder(combine_over(None), data_world=1)
    distill = Distill(
        None, DistillOptions(teacher="unused", alpha=0.5, temperature=2.0), recorder.record
    )
    inputs = torch.zeros_like(targets)
    distill.prepare(inputs, targets, torch.tensor(1.0))
    distill.loss(student, teacher, targets)
    distill.loss(student, teacher, targets)  # two micro-batches of the same step
    counted = int((targets != IGNORE).sum())
    ce = by_hand(student, teacher, targets, 1.0, 2.0) / counted
    kl = by_hand(student, teacher, targets, 0.0, 2.0) / 4.0 / counted
    recorded = recorder.current
    assert all(isinstance(v, torch.Tensor) for v in recorded.values())  # not read yet
    got = recorder.read(recorded)
    assert got == pytest.approx({"distill/ce": float(ce), "distill/kl": float(kl)}, rel=1e-5)
    assert recorder.directions == {"distill/ce": "lower", "distill/kl": "lower"}

    recorder.new_step()
    distill.prepare(inputs, targets, torch.tensor(1.0))  # the next step starts its own sums
    distill.loss(student, teacher, targets)
    again = recorder.read(recorder.current)
    assert again == pytest.approx({"distill/ce": float(ce), "distill/kl": float(kl)}, rel=1e-5)


def test_alpha_one_is_the_cross_entropy_objective_exactly():
    student, teacher, targets = random_batch(7)
    got = objective(alpha=1.0, temperature=3.0, z_loss=1e-3).loss(student, teacher, targets)
    assert torch.equal(got, cross_entropy_sum(1e-3)(student, targets))


def test_prepare_stacks_inputs_with_targets_for_each_micro_batch():
    inputs, targets = torch.arange(12).view(2, 6), torch.arange(12).view(2, 6) + 1
    packed = objective().prepare(inputs, targets, 12.0)
    assert packed.shape == (2, 6, 2)
    assert torch.equal(packed[1, :, 0], inputs[1]) and torch.equal(packed[1, :, 1], targets[1])


@pytest.fixture(scope="module")
def teacher_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("distill")
    data = ts.pack_corpus(tmp / "data")
    config = ts.run_config(data, tmp / "runs", "teacher")
    config["training"] = {"steps": 20, "log_every": 1, "checkpoint_every": 20}
    config["data"].pop("eval")
    ts.run(ts.llmtrain("run", ts.write_config(tmp / "teacher.yaml", config)), timeout=300)
    return tmp, config


def test_a_student_learns_from_its_teacher_through_the_cli(teacher_run):
    tmp, config = teacher_run
    student = {**config, "name": "student", "seed": 11}
    student["training"] = {
        "steps": 12,
        "log_every": 1,
        "objective": {"kind": "distill", "teacher": str(tmp / "runs" / "teacher"), "alpha": 0.2,
                      "temperature": 2.0},
    }  # fmt: skip
    proc = ts.run(ts.llmtrain("run", ts.write_config(tmp / "student.yaml", student)), timeout=300)
    assert ts.error_lines(proc.stderr) == []
    metrics = ts.by_step(ts.read_metrics(tmp / "runs" / "student"))
    assert list(metrics) == list(range(1, 13))
    kl = [metrics[s]["distill/kl"] for s in metrics]
    assert all(k >= 0 for k in kl) and all("distill/ce" in m for m in metrics.values())
    assert sum(kl[-3:]) / 3 < 0.7 * sum(kl[:3]) / 3, kl
    resolved = (tmp / "runs" / "student" / "config.yaml").read_text()
    assert "kind: distill" in resolved and "temperature: 2.0" in resolved


def test_a_missing_teacher_is_one_error_line(teacher_run, run_cli):
    tmp, config = teacher_run
    student = {**config, "name": "nowhere", "run_dir": str(tmp / "other")}
    student["training"] = {"steps": 2, "objective": {"kind": "distill", "teacher": str(tmp / "no")}}
    code, _, err = run_cli("run", ts.write_config(tmp / "nowhere.yaml", student))
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1, err
    assert "training.objective.teacher" in lines[0] and str(tmp / "no") in lines[0]


def test_a_teacher_with_shorter_positions_than_the_students_seq_len_is_refused(
    teacher_run, run_cli
):
    tmp, config = teacher_run  # the teacher: model.max_seq_len 64
    student = {**config, "name": "longer", "run_dir": str(tmp / "longer")}
    student["model"] = {**config["model"], "max_seq_len": 128}
    student["data"] = {**config["data"], "seq_len": 96}
    teacher = tmp / "runs" / "teacher"
    student["training"] = {"steps": 2, "objective": {"kind": "distill", "teacher": str(teacher)}}
    code, _, err = run_cli("run", ts.write_config(tmp / "longer.yaml", student))
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1, err
    assert lines[0] == (
        f"error: training.objective.teacher: the teacher {teacher} takes at most 64 tokens "
        "(its model.max_seq_len), fewer than the student's data.seq_len (96); distill from a "
        "teacher trained with max_seq_len of at least 96, or lower data.seq_len"
    )
    assert not (tmp / "longer" / "longer" / "checkpoints").exists()


def test_pipeline_parallelism_is_refused_naming_the_config_path():
    from llmtrain_distill.objective import build

    context = ObjectiveContext(parts=[], device="cpu", config={"mesh": {"pp": 2}})
    with pytest.raises(UserError, match=r"training.objective: .*mesh.pp=2"):
        build(DistillOptions(teacher="x"), context)
