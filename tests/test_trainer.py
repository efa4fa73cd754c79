"""DFlashTrainer: train/serve consistency (oracle 1), frozen target (oracle 5), exact loss
normalisation over gradient accumulation, end-to-end training, resume after a crash."""

import copy
import json

import pytest
import torch
from transformers import AutoModel, TrainerCallback

from hf_dflash import DFlashDraftModel
from hf_dflash.hub_cards import TrainingRecordCallback
from hf_dflash.trainer import DFlashDataCollator, DFlashTrainer, DFlashTrainingArguments, compute_target_features
from hf_dflash.trainer.forward import dflash_training_forward
from hf_dflash.trainer.trainer import check_fsdp_settings
from tests.conftest import make_drafter, make_target
from tests.helpers.training import BLOCK, TWO_CPU_PROCESSES, accelerate_launcher, arguments, run_worker, samples


def test_packed_training_forward_equals_inference_forward_per_block():
    """Oracle 1: each block of the packed multi-block forward == the drafter's inference forward with
    context = features[:p] (the generation path), in fp32."""
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=BLOCK)
    collator = DFlashDataCollator(BLOCK, num_anchors=5, mask_token_id=drafter.config.mask_token_id, gamma=3.0)
    batch = collator(samples(count=2))
    features = compute_target_features(
        target, batch["input_ids"], drafter.config.target_layer_ids, batch["attention_mask"]
    )
    embedding = target.get_input_embeddings()
    with torch.no_grad():
        packed = dflash_training_forward(drafter, embedding, batch, features, drafter.config)
        for row in range(2):
            for anchor in range(batch["anchor_positions"].shape[1]):
                if not batch["anchor_valid"][row, anchor]:
                    continue
                p = int(batch["anchor_positions"][row, anchor])
                block = slice(anchor * BLOCK, (anchor + 1) * BLOCK)
                served = drafter(
                    noise_embeds=embedding(batch["block_ids"][row : row + 1, block]),
                    context_hidden_states=features[row : row + 1, :p],
                    position_ids=torch.arange(p + BLOCK)[None],
                ).last_hidden_state
                assert (served - packed[row : row + 1, block]).abs().max() < 1e-5


def test_one_step_trains_only_the_drafter(tmp_path):
    """Oracle 5: drafter weights change; target, its embedding and LM head do not."""
    target = make_target("llama")
    drafter = make_drafter(target, block_size=BLOCK)
    target_before = copy.deepcopy(target.state_dict())
    drafter_before = copy.deepcopy(drafter.state_dict())
    trainer = DFlashTrainer(drafter, arguments(tmp_path, max_steps=1), target=target, train_dataset=samples())
    trainer.train()
    assert all(torch.equal(value, target.state_dict()[key]) for key, value in target_before.items())
    changed = [key for key, value in drafter_before.items() if not torch.equal(value, drafter.state_dict()[key])]
    assert set(changed) == set(drafter_before)  # every drafter weight received a gradient step


def one_step_weights(tmp_path, name, **overrides):
    target = make_target("llama")
    drafter = make_drafter(target, block_size=BLOCK)
    # num_anchors >= candidates: every candidate is an anchor, so both runs see the same blocks
    args = arguments(tmp_path / name, max_steps=1, num_anchors=64, optim="sgd", learning_rate=1.0, **overrides)
    DFlashTrainer(drafter, args, target=target, train_dataset=samples(count=4)).train()
    return drafter.state_dict()


def test_gradient_accumulation_equals_one_big_batch(tmp_path):
    """Σ w·CE / Σ w over the whole accumulated batch: 2 micro-batches of 2 == 1 batch of 4 (SGD, lr 1)."""
    big = one_step_weights(tmp_path, "big", per_device_train_batch_size=4, gradient_accumulation_steps=1)
    accumulated = one_step_weights(tmp_path, "acc", per_device_train_batch_size=2, gradient_accumulation_steps=2)
    for key in big:
        torch.testing.assert_close(accumulated[key], big[key], rtol=1e-4, atol=1e-6)


def test_dpace_loss_is_the_dpace_weighted_cross_entropy(tmp_path):
    """position_weighting='dpace': loss = Σ w·CE / Σ w with w the D-PACE weights of the drafter's own
    confidence on the batch (recomputed here from the packed forward), and a step trains the drafter."""
    from hf_dflash.trainer.maths import dpace_weights

    target = make_target("llama")
    drafter = make_drafter(target, block_size=BLOCK)
    args = arguments(tmp_path, max_steps=1, position_weighting="dpace", dpace_alpha=0.3)
    trainer = DFlashTrainer(drafter, args, target=target, train_dataset=samples(count=4))
    batch = trainer.data_collator(samples(count=2))
    with torch.no_grad():
        loss = trainer.compute_loss(drafter, batch)
        features = compute_target_features(target, batch["input_ids"], [1, 3], batch["attention_mask"])
        hidden = dflash_training_forward(drafter, target.get_input_embeddings(), batch, features, drafter.config)
        ce = torch.nn.functional.cross_entropy(
            target.lm_head(hidden).flatten(0, 1), batch["labels"].flatten(), reduction="none"
        ).view(batch["labels"].shape)
    supervised = batch["loss_weights"] > 0
    blocks = lambda t: t.reshape(-1, BLOCK)[:, 1:]  # noqa: E731
    weights = dpace_weights(torch.exp(-blocks(ce)), blocks(supervised), alpha=0.3)
    expected = (blocks(ce) * weights).sum() / weights.sum()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    before = copy.deepcopy(drafter.state_dict())
    trainer.train()
    assert any(not torch.equal(value, drafter.state_dict()[key]) for key, value in before.items())


def test_tiny_end_to_end_training_lowers_loss_and_saves_a_loadable_drafter(tmp_path):
    target = make_target("llama")
    drafter = make_drafter(target, block_size=BLOCK)
    data = samples(count=4, length=20) * 8  # the same few sequences: the drafter can fit them
    trainer = DFlashTrainer(
        drafter, arguments(tmp_path, num_train_epochs=3, learning_rate=5e-3), target=target, train_dataset=data
    )
    trainer.train()
    history = [entry for entry in trainer.state.log_history if "loss" in entry]
    print([(round(h["loss"], 3), h["tau"]) for h in history])
    first, last = history[:6], history[-6:]
    mean = lambda entries, key: sum(entry[key] for entry in entries) / len(entries)  # noqa: E731
    # the tiny frozen LM head has small logits, so CE cannot go far below ln(128); τ shows the learning
    assert mean(last, "loss") < mean(first, "loss") - 0.1
    assert mean(last, "tau") > mean(first, "tau") + 0.5
    assert {"tau", "acc_1", f"acc_{BLOCK - 1}"} <= set(history[-1])
    trainer.save_model(str(tmp_path / "drafter"))
    reloaded = AutoModel.from_pretrained(str(tmp_path / "drafter"), trust_remote_code=True)
    assert isinstance(reloaded, DFlashDraftModel)
    for key, value in drafter.state_dict().items():
        assert torch.equal(value, reloaded.state_dict()[key])


class CrashAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise RuntimeError("simulated crash")


def test_resume_after_crash_continues_from_last_checkpoint(tmp_path):
    def run(output, callbacks=(), resume=False):
        target = make_target("llama")
        drafter = make_drafter(target, block_size=BLOCK)
        args = arguments(tmp_path, output_dir=str(output), max_steps=6, save_strategy="steps", save_steps=2)
        trainer = DFlashTrainer(drafter, args, target=target, train_dataset=samples(), callbacks=list(callbacks))
        trainer.train(resume_from_checkpoint=resume)
        return drafter.state_dict()

    uninterrupted = run(tmp_path / "straight")
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(tmp_path / "crashy", callbacks=[CrashAt(5), TrainingRecordCallback({"chats": 8})])
    assert (tmp_path / "crashy" / "checkpoint-4" / "model.safetensors").exists()
    state = json.loads((tmp_path / "crashy" / "checkpoint-4" / "trainer_state.json").read_text())
    before_crash = state["stateful_callbacks"]["TrainingRecordCallback"]["attributes"]["earlier_training_time_s"]
    resumed = run(tmp_path / "crashy", callbacks=[TrainingRecordCallback({"chats": 8})], resume=True)
    for key in uninterrupted:
        torch.testing.assert_close(resumed[key], uninterrupted[key], rtol=1e-5, atol=1e-6)
    # the record's training time is the whole run's: the checkpoint's time before the crash, plus the resumed part
    record = json.loads((tmp_path / "crashy" / "training_record.json").read_text())
    assert 0 < before_crash < record["training_time_s"] and record["global_steps"] == 6


def test_arguments_validate():
    with pytest.raises(ValueError, match="feature_mode"):
        DFlashTrainingArguments(output_dir="x", feature_mode="cached", report_to=[])
    with pytest.raises(ValueError, match="position_weighting"):
        DFlashTrainingArguments(output_dir="x", position_weighting="linear", report_to=[])
    with pytest.raises(ValueError, match="distill_weight"):
        DFlashTrainingArguments(output_dir="x", loss_type="ce+kl", distill_weight=1.5, report_to=[])
    with pytest.raises(ValueError, match="dpace_alpha"):
        DFlashTrainingArguments(output_dir="x", position_weighting="dpace", dpace_alpha=0, report_to=[])
    with pytest.raises(ValueError, match="anchor_decay_tokens"):
        DFlashTrainingArguments(output_dir="x", anchor_decay_tokens=-1, report_to=[])
    assert DFlashTrainingArguments(output_dir="x", block_size=10, report_to=[]).loss_decay_gamma == 5.0


def test_anchor_decay_tokens_reaches_the_collator_and_tilts_the_anchors(tmp_path):
    """The trainer's collator draws anchors with the argument's weighting: more early anchors."""
    target = make_target("llama")
    drafter = make_drafter(target, block_size=BLOCK)
    data = samples(count=4, length=200)
    early = {}
    for decay in (0.0, 4.0):
        args = arguments(tmp_path / str(decay), max_steps=1, num_anchors=8, anchor_decay_tokens=decay)
        trainer = DFlashTrainer(drafter, args, target=target, train_dataset=data)
        assert trainer.data_collator.anchor_decay_tokens == decay
        torch.manual_seed(0)
        batches = [trainer.data_collator(data) for _ in range(20)]
        offsets = [
            (batch["anchor_positions"] - batch["loss_mask"].argmax(-1, keepdim=True))[batch["anchor_valid"]]
            for batch in batches
        ]
        early[decay] = torch.cat(offsets).float().mean().item()
    assert early[4.0] < 0.6 * early[0.0]  # uniform ~93 tokens into a 194-token reply; weighted ~45


def test_mismatched_target_is_refused(tmp_path):
    target = make_target("llama")
    other = make_drafter(make_target("qwen3"), block_size=BLOCK, hidden_size=48, target_hidden_size=48)
    with pytest.raises(ValueError, match="target_hidden_size=48"):
        DFlashTrainer(other, arguments(tmp_path), target=target, train_dataset=samples())


@pytest.mark.slow
def test_data_parallel_on_two_cpu_processes_equals_one_big_batch(tmp_path):
    """`accelerate launch` with 2 gloo processes x batch 1 == 1 process x batch 2 (SGD, lr 1)."""
    import sys
    from pathlib import Path

    from safetensors.torch import load_file

    worker = str(Path(__file__).parent / "dp_worker.py")
    single, parallel = tmp_path / "single.safetensors", tmp_path / "parallel.safetensors"
    run_worker([sys.executable, worker, str(single), "2"])
    launcher = accelerate_launcher(*TWO_CPU_PROCESSES)
    run_worker([*launcher, worker, str(parallel), "1"])
    expected, actual = load_file(single), load_file(parallel)
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=1e-4, atol=1e-6)


FSDP_OPTIONS = (
    "--config_file",
    "configs/accelerate/fsdp2.yaml",  # the documented GPU config; use_cpu=True in the arguments makes it CPU + gloo
    "--num_processes",
    "2",
)


@pytest.mark.slow
def test_fsdp2_on_two_cpu_processes_equals_one_process_and_resumes(tmp_path):
    """accelerate's FSDP2 path (forced on CPU by the worker: accelerate 1.16 enables FSDP on GPUs only), 2 gloo
    processes x batch 1 == 1 process x batch 2, 3 SGD-momentum steps: the same loss at every step and the same
    drafter; the files are Hub-native (our remote code, not torch's FSDP files); a run resumed from checkpoint-1 ends
    bit-identical to the uninterrupted one (the sharded momentum restored)."""
    import json
    import os
    import sys
    from pathlib import Path

    from safetensors.torch import load_file

    root, worker = Path(__file__).resolve().parents[1], "tests/fsdp_worker.py"
    single, sharded, resumed = tmp_path / "single", tmp_path / "fsdp", tmp_path / "resumed"
    run_worker([sys.executable, worker, str(single), "2", "3"], cwd=root)
    env = os.environ | {"FORCE_FSDP2": "1"}
    launch = [*accelerate_launcher(*FSDP_OPTIONS), worker]
    run_worker([*launch, str(sharded), "1", "3"], cwd=root, env=env)
    checkpoint = str(sharded / "run" / "checkpoint-1")
    run_worker([*launch, str(resumed), "1", "3", checkpoint], cwd=root, env=env)
    losses = {
        name: json.loads((folder / "losses.json").read_text()) for name, folder in (("1", single), ("2", sharded))
    }
    assert list(losses["1"]) == ["1", "2", "3"]
    # measured: 1 process 4.886100, 4.848287, 4.820493; FSDP the same to <= 1e-7 relative (summation order)
    torch.testing.assert_close(losses["2"], losses["1"], rtol=1e-5, atol=0)
    expected, actual = (
        load_file(single / "final" / "model.safetensors"),
        load_file(sharded / "final" / "model.safetensors"),
    )
    assert set(actual) == set(expected)
    for key in expected:  # measured max abs difference 3.7e-8: the gradient reduce-scatter sums in another order
        torch.testing.assert_close(actual[key], expected[key], rtol=1e-4, atol=1e-6)
    for folder in (sharded / "final", sharded / "run" / "checkpoint-1"):
        assert {path.name for path in folder.glob("*.py")} == {"configuration_dflash.py", "modeling_dflash.py"}
        assert (
            json.loads((folder / "config.json").read_text())["auto_map"]["AutoModel"]
            == "modeling_dflash.DFlashDraftModel"
        )
    assert DFlashDraftModel.from_pretrained(sharded / "final").state_dict().keys() == expected.keys()
    after_resume = load_file(resumed / "final" / "model.safetensors")
    assert all(torch.equal(after_resume[key], actual[key]) for key in actual)


@pytest.mark.slow
def test_fsdp_launch_on_cpu_is_refused_instead_of_silently_running_ddp(tmp_path):
    """accelerate 1.16 runs an FSDP config on CPU processes as MULTI_CPU (DDP) without a word: the trainer refuses."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    run = subprocess.run(
        [*accelerate_launcher(*FSDP_OPTIONS), "tests/fsdp_worker.py", str(tmp_path), "1", "1"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode != 0
    assert "ValueError: FSDP was requested, but accelerate runs this job as MULTI_CPU" in run.stderr
    assert "--multi_gpu" in run.stderr


@pytest.mark.parametrize(
    "requested, enabled, state_dict_type, message",
    [
        (True, False, None, "runs this job as MULTI_CPU, not FSDP"),
        (True, True, "StateDictType.SHARDED_STATE_DICT", "fsdp_state_dict_type=SHARDED_STATE_DICT"),
    ],
)
def test_fsdp_settings_that_would_go_wrong_are_refused(requested, enabled, state_dict_type, message):
    with pytest.raises(ValueError, match=message):
        check_fsdp_settings(requested, enabled, "MULTI_CPU", state_dict_type)
    check_fsdp_settings(False, False, "MULTI_CPU", None)  # no FSDP asked for: DDP or one process
    check_fsdp_settings(True, True, "FSDP", "StateDictType.FULL_STATE_DICT")


def test_lora_fine_tuning_of_an_existing_drafter(tmp_path):
    """PEFT LoRA on the drafter's attention: only the adapted projections change once merged."""
    from peft import LoraConfig, get_peft_model

    target = make_target("llama")
    drafter = make_drafter(target, block_size=BLOCK)
    before = copy.deepcopy(drafter.state_dict())
    adapted = get_peft_model(drafter, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    DFlashTrainer(adapted, arguments(tmp_path, max_steps=2), target=target, train_dataset=samples()).train()
    merged = adapted.merge_and_unload()
    assert isinstance(merged, DFlashDraftModel)
    changed = {key for key, value in before.items() if not torch.equal(value, merged.state_dict()[key])}
    assert changed == {f"layers.{i}.self_attn.{name}_proj.weight" for i in range(2) for name in ("q", "v")}


def test_offline_features_give_the_online_loss(tmp_path):
    """The same batch through cached (fp32) features and through the live target: same loss."""
    import json

    from hf_dflash.trainer import OfflineFeatureDataset, cache_features

    target = make_target("llama")
    drafter = make_drafter(target, block_size=BLOCK)
    data = samples(count=4)
    (tmp_path / "tok").mkdir()
    with (tmp_path / "tok" / "tokenized-00000.jsonl").open("w") as handle:
        for i, sample in enumerate(data):
            handle.write(json.dumps({"id": f"s{i}", **sample}) + "\n")
    cache_features(target, tmp_path / "tok", tmp_path / "features", [1, 3], dtype=torch.float32)
    offline = OfflineFeatureDataset(tmp_path / "features", tmp_path / "tok", target_layer_ids=[1, 3], hidden_size=32)
    losses = {}
    for mode, dataset in (("online", data), ("offline", [offline[i] for i in range(4)])):
        collator = DFlashDataCollator(
            BLOCK, 6, drafter.config.mask_token_id, 3.0, generator=torch.Generator().manual_seed(0)
        )
        trainer = DFlashTrainer(
            drafter, arguments(tmp_path / mode, feature_mode=mode), target=target, data_collator=collator
        )
        batch = collator(dataset)
        with torch.no_grad():
            losses[mode] = trainer.compute_loss(drafter, batch)
    torch.testing.assert_close(losses["offline"], losses["online"], rtol=1e-5, atol=1e-6)


def write_samples(folder, data) -> None:
    import json

    folder.mkdir()
    with (folder / "tokenized-00000.jsonl").open("w") as handle:
        for i, sample in enumerate(data):
            handle.write(json.dumps({"id": f"s{i}", **sample}) + "\n")


@pytest.mark.parametrize("loss_type", ["kl", "ce+kl"])
@pytest.mark.parametrize("vocabulary", ["full", "pruned"])
@pytest.mark.parametrize("weighting", ["decay", "dpace"])
def test_offline_distillation_from_a_whole_cached_teacher_gives_the_online_loss(
    tmp_path, loss_type, vocabulary, weighting
):
    """The target's distribution cached in full (top-K with K = V) and read back offline: the same loss as
    distilling from the live target, for KL and the CE+KL mix, full or pruned draft vocabulary, both weightings."""
    from hf_dflash.trainer import OfflineFeatureDataset, cache_features
    from tests.conftest import VOCAB, pruned_drafter

    target = make_target("llama")
    drafter = (
        make_drafter(target, block_size=BLOCK) if vocabulary == "full" else pruned_drafter(target, block_size=BLOCK)
    )
    data = samples(count=4)
    write_samples(tmp_path / "tok", data)
    cache_features(target, tmp_path / "tok", tmp_path / "features", [1, 3], dtype=torch.float32, teacher_top_k=VOCAB)
    offline = OfflineFeatureDataset(tmp_path / "features", tmp_path / "tok", target_layer_ids=[1, 3], hidden_size=32)
    losses = {}
    for mode, dataset in (("online", data), ("offline", [offline[i] for i in range(4)])):
        collator = DFlashDataCollator(
            BLOCK, 6, drafter.config.mask_token_id, 3.0, generator=torch.Generator().manual_seed(0)
        )
        settings = dict(feature_mode=mode, loss_type=loss_type, position_weighting=weighting, distill_weight=0.3)
        trainer = DFlashTrainer(drafter, arguments(tmp_path / mode, **settings), target=target, data_collator=collator)
        with torch.no_grad():
            losses[mode] = trainer.compute_loss(drafter, collator(dataset))
    torch.testing.assert_close(losses["offline"], losses["online"], rtol=1e-5, atol=1e-6)
    ce = DFlashTrainer(drafter, arguments(tmp_path / "ce", feature_mode="offline"), target=target)
    with torch.no_grad():
        assert not torch.isclose(ce.compute_loss(drafter, collator(dataset)), losses["offline"])  # the KL counts


def test_offline_distillation_refuses_a_cache_without_a_teacher(tmp_path):
    from hf_dflash.trainer import OfflineFeatureDataset, cache_features

    target = make_target("llama")
    drafter = make_drafter(target, block_size=BLOCK)
    write_samples(tmp_path / "tok", samples(count=2))
    cache_features(target, tmp_path / "tok", tmp_path / "features", [1, 3], dtype=torch.float32)
    offline = OfflineFeatureDataset(tmp_path / "features", tmp_path / "tok", target_layer_ids=[1, 3], hidden_size=32)
    collator = DFlashDataCollator(BLOCK, 6, drafter.config.mask_token_id, 3.0)
    args = arguments(tmp_path / "kl", feature_mode="offline", loss_type="kl")
    trainer = DFlashTrainer(drafter, args, target=target, data_collator=collator)
    with pytest.raises(ValueError, match="cache-features --teacher-top-k"):
        trainer.compute_loss(drafter, collator([offline[0], offline[1]]))
    # ... and training from a config refuses it before the first step
    from hf_dflash.trainer.train import build_datasets

    section = {"features": str(tmp_path / "features"), "tokenized": str(tmp_path / "tok")}
    with pytest.raises(ValueError, match="loss_type='kl' offline .* --teacher-top-k 32"):
        build_datasets(section, args, drafter, 128)


def test_flex_block_mask_equals_the_dense_mask_and_gives_the_same_forward():
    """The flex-attention BlockMask (GPU training) encodes exactly the dense SDPA/eager mask."""
    from hf_dflash.trainer.maths import build_training_block_mask, build_training_mask, training_mask_mod

    target = make_target("qwen3")
    collator = DFlashDataCollator(BLOCK, num_anchors=5, mask_token_id=127, gamma=3.0)
    batch = collator(samples(count=2))
    anchors, valid, seq_len = batch["anchor_positions"], batch["anchor_valid"], batch["input_ids"].shape[1]
    dense = build_training_mask(anchors, valid, seq_len, BLOCK)[:, 0]
    queries, keys = torch.arange(dense.shape[1]), torch.arange(dense.shape[2])
    mask_mod = training_mask_mod(anchors, valid, seq_len, BLOCK)
    for row in range(2):
        evaluated = mask_mod(torch.tensor(row), None, queries[:, None], keys[None, :])
        assert torch.equal(evaluated, dense[row])
    features = compute_target_features(target, batch["input_ids"], [1, 3], batch["attention_mask"])
    outputs = {}
    torch._dynamo.reset()  # compiled afresh: torch 2.13's CPU flex template fails on a dynamic-shape recompile
    for implementation in ("sdpa", "flex_attention"):
        drafter = make_drafter(target, block_size=BLOCK)
        drafter.set_attn_implementation(implementation)
        with torch.no_grad():
            outputs[implementation] = dflash_training_forward(
                drafter, target.get_input_embeddings(), batch, features, drafter.config
            )
    assert build_training_block_mask(anchors, valid, seq_len, BLOCK).shape[-2:] == dense.shape[-2:]
    torch.testing.assert_close(outputs["flex_attention"], outputs["sdpa"], rtol=1e-4, atol=1e-5)
    assert not torch.isnan(outputs["sdpa"]).any()  # padding blocks produce no NaN
