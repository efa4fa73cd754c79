"""Training with a pruned draft vocabulary: frequency selection, the loss over the subset, the record."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hf_dflash.checkpoints import load_drafter
from hf_dflash.trainer.draft_vocab import (
    draft_vocab_report,
    select_draft_vocab,
    size_for_coverage,
    supervised_token_counts,
)
from hf_dflash.trainer.maths import target_to_draft_index, weighted_cross_entropy_sum
from hf_dflash.trainer.train import load_train_config, train_from_config


def test_counts_cover_supervised_tokens_only():
    samples = [{"input_ids": [5, 6, 6, 7], "loss_mask": [0, 1, 1, 1]}, {"input_ids": [5, 8], "loss_mask": [1, 0]}]
    counts = supervised_token_counts(samples, vocab_size=10)
    assert counts.tolist() == [0, 0, 0, 0, 0, 1, 2, 1, 0, 0]


def test_selection_takes_the_most_frequent_and_keeps_forced_ids():
    counts = torch.tensor([0, 50, 5, 30, 10, 1, 4])
    assert select_draft_vocab(counts, 3).tolist() == [1, 3, 4]
    assert select_draft_vocab(counts, 3, always=[0]).tolist() == [0, 1, 3]  # EOS never seen, still kept
    assert (
        size_for_coverage(counts, 0.5) == 1
        and size_for_coverage(counts, 0.8) == 2
        and size_for_coverage(counts, 1.0) == 6
    )
    report = draft_vocab_report(counts, select_draft_vocab(counts, 3))
    assert report["draft_vocab_size"] == 3 and report["coverage"] == pytest.approx(90 / 100)
    assert report["size_for_coverage"]["0.9"] == 3


@pytest.mark.parametrize("size,always", [(8, []), (0, []), (1, [0, 1]), (2, [9])])
def test_bad_selection_is_named(size, always):
    with pytest.raises(ValueError, match="draft_vocab_size|must lie in"):
        select_draft_vocab(torch.ones(7, dtype=torch.long), size, always=always)


def test_loss_over_the_subset_equals_cross_entropy_over_its_logits():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 12, bias=False)
    ids = torch.tensor([1, 3, 4, 7, 10])
    t2d = torch.zeros(12, dtype=torch.bool)
    t2d[ids] = True
    hidden = torch.randn(1, 6, 8)
    labels = torch.tensor([[3, 7, 2, 10, 1, 5]])  # 2 and 5 lie outside the subset
    weights = torch.tensor([[1.0, 0.5, 1.0, 0.0, 0.25, 1.0]])
    loss_sum, correct = weighted_cross_entropy_sum(
        hidden, head, labels, weights, (head.weight[ids], target_to_draft_index(t2d))
    )
    logits = hidden[0] @ head.weight[ids].T
    expected = 0.0
    for position, label in enumerate(labels[0].tolist()):
        if weights[0, position] > 0 and label in ids.tolist():
            target = ids.tolist().index(label)
            expected += weights[0, position] * F.cross_entropy(logits[position : position + 1], torch.tensor([target]))
    torch.testing.assert_close(loss_sum, torch.as_tensor(expected))
    assert not correct[0, 2] and not correct[0, 5]  # outside the subset: never correct
    assert target_to_draft_index(t2d).tolist() == [-1, 0, -1, 1, 2, -1, -1, 3, -1, -1, 4, -1]


def test_training_with_a_draft_vocab_chooses_it_from_the_data_and_records_coverage(run_config):  # noqa: F811
    config = load_train_config(run_config)
    config["drafter"]["draft_vocab_size"] = 40
    trainer = train_from_config(config)
    output = Path(trainer.args.output_dir)
    drafter = load_drafter(output)
    record = json.loads((output / "training_record.json").read_text())
    assert record["draft_vocab"]["draft_vocab_size"] == 40 and 0 < record["draft_vocab"]["coverage"] <= 1
    assert 2 in drafter.draft_token_ids.tolist()  # the target's EOS (conftest: eos_token_id=2) is kept
    logged = [entry for entry in trainer.state.log_history if "draft_vocab_miss" in entry]
    assert logged and all(0 <= entry["draft_vocab_miss"] <= 1 for entry in logged)
    assert any("eval_draft_vocab_miss" in entry for entry in trainer.state.log_history)


def test_kl_loss_is_zero_when_the_drafter_matches_the_teacher_and_positive_otherwise():
    from hf_dflash.trainer.maths import selected_logits, weighted_kl_sum

    torch.manual_seed(0)
    head = torch.nn.Linear(8, 12, bias=False)
    hidden = torch.randn(1, 4, 8)
    weights = torch.tensor([[0.0, 1.0, 0.5, 1.0]])
    selected = weights > 0
    teacher = head(hidden[selected])
    student = selected_logits(hidden, head, selected)
    assert weighted_kl_sum(student, teacher, weights[selected]).abs() < 1e-5
    assert weighted_kl_sum(student, teacher + torch.randn_like(teacher), weights[selected]) > 0.01
    ids = torch.tensor([1, 3, 4, 7, 10])
    t2d = torch.zeros(12, dtype=torch.bool)
    t2d[ids] = True
    draft_head = (head.weight[ids], target_to_draft_index(t2d))
    subset = weighted_kl_sum(
        selected_logits(hidden, head, selected, draft_head), teacher, weights[selected], draft_head
    )
    assert subset.abs() < 1e-5  # the teacher renormalised over the subset equals the drafter's subset softmax


def test_distillation_trains_online(run_config):  # noqa: F811
    from hf_dflash.trainer.arguments import DFlashTrainingArguments

    config = load_train_config(run_config)
    config["training"].update(loss_type="kl", max_steps=2, eval_strategy="no", save_strategy="no")
    trainer = train_from_config(config)
    assert trainer.state.global_step == 2 and trainer.state.log_history[0]["loss"] > 0
    with pytest.raises(ValueError, match="loss_type must be one of"):
        DFlashTrainingArguments(output_dir="x", loss_type="mse", use_cpu=True)
