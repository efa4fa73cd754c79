"""DFlash2 trained (issue 34, part 3): the K-way selector loss against a hand-written oracle (teacher-forced
predecessors, the label injected when it is missing from the top-K), the trainer's loss = DFlash loss +
selector_loss_weight x selector loss under both position weightings, and a step that trains the selector."""

import copy

import pytest
import torch

from hf_dflash.trainer import DFlashTrainer, compute_target_features
from hf_dflash.trainer.forward import dflash_training_forward
from hf_dflash.trainer.maths import block_predecessors, dpace_weights, selector_cross_entropy
from hf_dflash.trainer.upgrade import dflash2_from_dflash
from tests.conftest import make_drafter, make_target
from tests.helpers.training import BLOCK, arguments, packed_equals_served, samples

K = 4


def selector_of(rank: int = 3, vocab: int = 10, hidden: int = 5, seed: int = 0):
    from hf_dflash.modeling_dflash.modeling_dflash import DFlashCandidateSelector

    torch.manual_seed(seed)
    selector = DFlashCandidateSelector(hidden, vocab, rank, K)
    with torch.no_grad():
        for parameter in selector.parameters():
            parameter.normal_()
    return selector


def test_block_predecessors_are_the_previous_label_and_the_anchor_for_slot_1():
    labels = torch.tensor([[10, 11, 12, 13, 20, 21, 22, 23]])  # two blocks of 4, slot 0 = the anchor
    assert block_predecessors(labels, 4)[0, [1, 2, 3, 5, 6, 7]].tolist() == [10, 11, 12, 20, 21, 22]


def test_selector_loss_by_hand_with_and_without_the_label_among_the_top_k():
    selector = selector_of()
    logits = torch.tensor([[5.0, 4, 3, 2, 1, 0, 0, 0, 0, 0], [0.0, 1, 2, 3, 4, 5, 6, 7, 8, 9]])
    hidden = torch.randn(2, 5)
    labels, predecessors = torch.tensor([2, 1]), torch.tensor([7, 3])  # row 1's label is not in its top 4
    losses, in_top_k, correct = selector_cross_entropy(logits, hidden, labels, predecessors, selector)
    assert in_top_k.tolist() == [True, False] and not correct[1]
    with torch.no_grad():
        for row, candidates in enumerate([[0, 1, 2, 3], [9, 8, 7, 1]]):  # row 1: the label replaces the 4th best
            projected = selector.hidden_projection(hidden[row])
            scores = torch.stack(
                [
                    logits[row, c]
                    + (
                        selector.predecessor_codebook[predecessors[row]] * projected * selector.successor_codebook[c]
                    ).sum()
                    for c in candidates
                ]
            )
            expected = -scores.log_softmax(-1)[candidates.index(int(labels[row]))]
            assert float(losses[row]) == pytest.approx(float(expected), abs=1e-5)
            if row == 0:
                assert bool(correct[0]) == (int(scores.argmax()) == 2)


def test_at_identity_the_selector_loss_is_the_cross_entropy_over_the_top_k():
    selector = selector_of()
    with torch.no_grad():
        selector.hidden_projection.weight.zero_()
    logits = torch.randn(6, 10)
    labels = logits.topk(K, dim=-1).indices[:, 1]  # the second best: always a candidate
    losses, in_top_k, correct = selector_cross_entropy(
        logits, torch.randn(6, 5), labels, torch.zeros(6, dtype=torch.long), selector
    )
    top = logits.topk(K, dim=-1).values
    torch.testing.assert_close(losses, -(top.log_softmax(-1)[:, 1]))
    assert in_top_k.all() and not correct.any()


def dflash2_pair(seed: int = 1):
    target = make_target("llama")
    drafter = dflash2_from_dflash(make_drafter(target, block_size=BLOCK, seed=seed), 2, 8, 6, K)
    with torch.no_grad():  # the selector off identity, so its term shows in the loss
        drafter.candidate_selector.hidden_projection.weight.normal_(0, 0.5)
        drafter.candidate_selector.predecessor_codebook.normal_()
        drafter.candidate_selector.successor_codebook.normal_()
    return target, drafter


def per_position_losses(trainer, target, drafter, batch):
    """(DFlash CE (B, T), selector loss (B, T), supervised (B, T)) recomputed from the packed forward."""
    supervised = batch["loss_weights"] > 0
    with torch.no_grad():
        features = compute_target_features(target, batch["input_ids"], [1, 3], batch["attention_mask"])
        hidden = dflash_training_forward(drafter, target.get_input_embeddings(), batch, features, drafter.config)
        logits = target.lm_head(hidden)
        ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none")
        selector = torch.zeros(supervised.shape)
        predecessors = block_predecessors(batch["labels"], BLOCK)
        selector[supervised] = selector_cross_entropy(
            logits[supervised], hidden[supervised], batch["labels"][supervised], predecessors[supervised],
            drafter.candidate_selector,
        )[0]  # fmt: skip
    return ce.view(supervised.shape), selector, supervised


@pytest.mark.parametrize("weighting", ["decay", "dpace"])
def test_the_trainer_adds_the_weighted_selector_loss(tmp_path, weighting):
    target, drafter = dflash2_pair()
    args = arguments(tmp_path, max_steps=1, position_weighting=weighting, selector_loss_weight=0.5)
    trainer = DFlashTrainer(drafter, args, target=target, train_dataset=samples(count=4))
    batch = trainer.data_collator(samples(count=2))
    with torch.no_grad():
        loss = trainer.compute_loss(drafter, batch)
    ce, selector, supervised = per_position_losses(trainer, target, drafter, batch)
    total = ce + 0.5 * selector
    if weighting == "decay":
        expected = (total * batch["loss_weights"]).sum() / batch["loss_weights"].sum()
    else:
        blocks = lambda t: t.reshape(-1, BLOCK)[:, 1:]  # noqa: E731
        weights = dpace_weights(torch.exp(-blocks(ce)), blocks(supervised), alpha=args.dpace_alpha)
        expected = (blocks(total) * weights).sum() / weights.sum()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)


def test_a_step_trains_the_selector_and_weight_0_leaves_its_codebooks(tmp_path):
    for weight, moves in [(1.0, True), (0.0, False)]:
        target, drafter = dflash2_pair()
        before = copy.deepcopy(drafter.candidate_selector.state_dict())
        args = arguments(
            tmp_path / str(weight), max_steps=1, selector_loss_weight=weight, optim="sgd", weight_decay=0.0
        )
        trainer = DFlashTrainer(drafter, args, target=target, train_dataset=samples(count=4))
        trainer.train()
        after = drafter.candidate_selector.state_dict()
        changed = {key for key in before if not torch.equal(before[key], after[key])}
        assert changed == (set(before) if moves else set())
        logged = {key for entry in trainer.state.log_history for key in entry}
        assert ("selector_acc" in logged) == moves and ("selector_top_k_recall" in logged) == moves


def test_selector_loss_weight_is_checked(tmp_path):
    with pytest.raises(ValueError, match="selector_loss_weight must be >= 0"):
        arguments(tmp_path, selector_loss_weight=-1.0)


def test_a_dflash_drafter_ignores_the_selector_weight(tmp_path):
    target = make_target("llama")
    drafter = make_drafter(target, block_size=BLOCK)
    trainer = DFlashTrainer(drafter, arguments(tmp_path, max_steps=1, selector_loss_weight=3.0), target=target)
    batch = trainer.data_collator(samples(count=2))
    with torch.no_grad():
        loss = trainer.compute_loss(drafter, batch)
        trainer.args.selector_loss_weight = 0.0
        assert torch.equal(loss, trainer.compute_loss(drafter, batch))


def test_the_loss_reads_the_logits_through_the_output_transforms(tmp_path):
    """z-lab's output_multiplier and final_logit_softcapping shape the logits served, so training's too."""
    target = make_target("llama")
    drafter = make_drafter(target, block_size=BLOCK, output_multiplier=0.5, final_logit_softcapping=3.0)
    trainer = DFlashTrainer(drafter, arguments(tmp_path, max_steps=1), target=target)
    batch = trainer.data_collator(samples(count=2))
    with torch.no_grad():
        loss = trainer.compute_loss(drafter, batch)
        features = compute_target_features(target, batch["input_ids"], [1, 3], batch["attention_mask"])
        hidden = dflash_training_forward(drafter, target.get_input_embeddings(), batch, features, drafter.config)
        logits = 3.0 * torch.tanh(target.lm_head(hidden) * 0.5 / 3.0)
        ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none")
    weights = batch["loss_weights"].flatten()
    torch.testing.assert_close(loss, (ce * weights).sum() / weights.sum(), rtol=1e-5, atol=1e-6)


def test_over_a_draft_vocabulary_the_selector_loss_is_the_full_vocabulary_one_with_other_ids_impossible():
    selector = selector_of(vocab=12)
    draft_ids = torch.tensor([0, 2, 3, 5, 7, 8, 11])
    generator = torch.Generator().manual_seed(3)
    pruned = torch.randn(5, len(draft_ids), generator=generator)
    full = torch.full((5, 12), float("-inf")).index_copy(1, draft_ids, pruned)
    hidden, predecessors = torch.randn(5, 5, generator=generator), torch.tensor([1, 4, 6, 9, 10])
    labels = torch.tensor([2, 11, 5, 4, 0])  # 4 is not a draft id
    losses, in_top_k, correct = selector_cross_entropy(pruned, hidden, labels, predecessors, selector, draft_ids)
    reference = selector_cross_entropy(full, hidden, labels, predecessors, selector)
    inside = torch.tensor([True, True, True, False, True])
    torch.testing.assert_close(losses[inside], reference[0][inside])
    assert losses[3] == 0 and not in_top_k[3] and not correct[3]
    assert torch.equal(in_top_k[inside], reference[1][inside]) and torch.equal(correct[inside], reference[2][inside])


def test_a_dflash_drafter_with_a_draft_vocabulary_upgrades_and_trains(tmp_path):
    target = make_target("llama")
    dflash = make_drafter(target, block_size=BLOCK, draft_vocab_size=40)
    dflash.set_draft_vocab(torch.randperm(128, generator=torch.Generator().manual_seed(0))[:40])
    drafter = dflash2_from_dflash(dflash, 2, 8, 6, K)
    assert torch.equal(drafter.draft_token_ids, dflash.draft_token_ids)
    trainer = DFlashTrainer(drafter, arguments(tmp_path, max_steps=2), target=target, train_dataset=samples(count=4))
    trainer.train()
    assert drafter.candidate_selector.hidden_projection.weight.abs().sum() > 0
    assert any("selector_acc" in entry for entry in trainer.state.log_history)


def test_the_selector_gets_its_own_learning_rate(tmp_path):
    """selector_learning_rate: the selector's weights in groups of their own at that peak (the scheduler scales
    every group alike), every parameter in exactly one group; a step trains with it."""
    target, drafter = dflash2_pair()
    args = arguments(tmp_path, max_steps=1, learning_rate=1e-3, selector_learning_rate=2e-2, warmup_steps=0)
    trainer = DFlashTrainer(drafter, args, target=target, train_dataset=samples(count=4))
    optimizer = trainer.create_optimizer()
    selector = {id(p) for p in drafter.candidate_selector.parameters()}
    seen = [id(p) for group in optimizer.param_groups for p in group["params"]]
    assert sorted(seen) == sorted(id(p) for p in drafter.parameters() if p.requires_grad)
    for group in optimizer.param_groups:
        kinds = {id(p) in selector for p in group["params"]}
        assert len(kinds) == 1 and group["lr"] == (2e-2 if kinds == {True} else 1e-3)
    trainer.train()
    assert any("selector_acc" in entry for entry in trainer.state.log_history)
    with pytest.raises(ValueError, match="selector_learning_rate must be > 0"):
        arguments(tmp_path, selector_learning_rate=0.0)


@pytest.mark.parametrize("start", ["dflash2_block_4", "dflash_block_4_upgraded"])
def test_training_at_another_block_size_trains_the_function_it_saves(run_config, tmp_path, start):
    """A block-4 drafter (DFlash2, or DFlash upgraded to DFlash2) trained at block 8 (issue 53): the convolutions
    trained and those served after save + load_drafter stop at the same block boundaries (< 1e-5, fp32)."""
    import yaml
    from transformers import AutoModelForCausalLM

    from hf_dflash.checkpoints import load_drafter
    from hf_dflash.checkpoints.hub import save_hub
    from hf_dflash.trainer.train import load_train_config, train_from_config
    from tests.helpers.training import write_tokenized

    config = yaml.safe_load(run_config.read_text())
    target = AutoModelForCausalLM.from_pretrained(config["target"], dtype=torch.float32).eval()
    upgrade = {"conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 4, "selector_top_k": 5}
    start_drafter = make_drafter(target, block_size=4, num_hidden_layers=1)
    if start == "dflash2_block_4":
        start_drafter = dflash2_from_dflash(start_drafter, **upgrade)
    save_hub(start_drafter, tmp_path / "start")
    write_tokenized(tmp_path / "long", samples(count=8, length=40))
    config["drafter"] = {"init_from": str(tmp_path / "start")}
    if start != "dflash2_block_4":
        config["drafter"]["upgrade_to_dflash2"] = upgrade
    config["data"]["tokenized"] = str(tmp_path / "long")
    config["training"].update(block_size=8, output_dir=str(tmp_path / "block8"), learning_rate=1e-2)
    (tmp_path / "block8.yaml").write_text(yaml.safe_dump(config))
    trained = train_from_config(load_train_config(tmp_path / "block8.yaml")).model.float().eval()
    served = load_drafter(tmp_path / "block8", dtype=torch.float32).eval()
    assert served.config.block_size == trained.config.block_size == 8
    assert packed_equals_served(trained, served, target, 8) < 1e-5
