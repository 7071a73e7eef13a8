"""The dashboard names the tensorboard and wandb loggers share: the loss first."""

from __future__ import annotations

from llmtrain.core_mesh.metric_names import DASHBOARD_NAMES, dashboard_metrics, dashboard_name


def test_every_name_llmtrain_logs_has_a_section_after_the_loss():
    assert dashboard_name("loss") == "loss/train"
    assert dashboard_name("eval_loss") == "loss/eval"
    assert dashboard_name("active_memory_mib") == "memory/active_mib"
    assert dashboard_name("tokens") == "progress/tokens"
    sections = {name.split("/")[0] for name in DASHBOARD_NAMES.values()}
    assert min(sections) == "loss" and len(set(DASHBOARD_NAMES.values())) == len(DASHBOARD_NAMES)


def test_sections_a_metric_chose_and_names_without_one():
    assert dashboard_name("downstream/hellaswag/acc_norm") == "tasks/hellaswag/acc_norm"
    assert dashboard_name("downstream/seconds") == "tasks/seconds"
    assert dashboard_name("moe/layer0/max_load") == "moe/layer0/max_load"
    assert dashboard_name("my_metric") == "other/my_metric"
    assert dashboard_name("eval_acc") == "other/eval_acc"


def test_a_step_lists_its_loss_first():
    step = {"tokens": 8.0, "active_memory_mib": 1.0, "lr": 0.1, "loss": 2.0, "eval_loss": 2.5}
    assert list(dashboard_metrics(step)) == [
        "loss/eval",
        "loss/train",
        "memory/active_mib",
        "optim/lr",
        "progress/tokens",
    ]
    assert dashboard_metrics(step)["loss/train"] == 2.0
