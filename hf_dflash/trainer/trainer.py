"""`DFlashTrainer`: a `Trainer` whose model is the drafter; the target is frozen and only lends
its features, embedding and LM head. Checkpoints therefore hold the drafter alone, Hub-native."""

import os
from pathlib import Path

import torch
from transformers import PreTrainedModel, Trainer

from ..hub_cards import TAGS as CARD_TAGS
from ..hub_cards import TRAINING_RECORD_NAME, render_model_card
from ..modeling_dflash import DFlashDraftModel
from ..modeling_dflash.modeling_dflash import transform_logits
from ..target_features import compute_target_features, compute_target_features_and_logits
from ..targets import KNOWN_TARGETS
from .arguments import DFlashTrainingArguments
from .collator import DFlashDataCollator
from .consistency import served_tau_estimate
from .forward import dflash_training_forward
from .maths import (
    acceptance_estimate,
    block_predecessors,
    dpace_block_weights,
    position_cross_entropy,
    position_kl,
    selected_logits,
    selector_cross_entropy,
    target_to_draft_index,
    top_k_teacher_logits,
)


def check_training_pairing(target: PreTrainedModel, drafter: DFlashDraftModel) -> None:
    """Sizes, vocab and layer ids must fit (dtype/device may differ in training, e.g. a bf16 target)."""
    text = target.config.get_text_config()
    config = drafter.config
    if (
        config.target_hidden_size != text.hidden_size
        or config.vocab_size != target.get_input_embeddings().weight.shape[0]
    ):
        raise ValueError(
            f"Drafter (target_hidden_size={config.target_hidden_size}, vocab_size={config.vocab_size}) does not fit "
            f"the target (hidden_size={text.hidden_size}, embedding rows={target.get_input_embeddings().weight.shape[0]}): "
            "build the drafter config with DFlashConfig.from_target_config(target.config)."
        )
    if max(config.target_layer_ids) >= text.num_hidden_layers:
        raise ValueError(
            f"target_layer_ids {config.target_layer_ids} exceed the target's {text.num_hidden_layers} layers."
        )


def check_fsdp_settings(requested: bool, enabled: bool, distributed_type: str, state_dict_type: str | None) -> None:
    """FSDP asked for (`requested`: accelerate's FSDP config or `--use_fsdp`, or `TrainingArguments.fsdp`) must be
    FSDP run (`enabled`), with checkpoints holding the whole drafter (FULL_STATE_DICT)."""
    if requested and not enabled:
        raise ValueError(
            f"FSDP was requested, but accelerate runs this job as {distributed_type}, not FSDP: accelerate (1.16) "
            "turns FSDP on only on GPU-like devices (CUDA, XPU, NPU, ...); on CPU it leaves the FSDP settings unused "
            "and would train plain data parallel (DDP) without a word. On CPU, launch with --multi_gpu (DDP over "
            "gloo) instead of the FSDP config; on GPUs, check that accelerate sees them."
        )
    if enabled and state_dict_type is not None and "FULL_STATE_DICT" not in state_dict_type:
        raise ValueError(
            f"fsdp_state_dict_type={state_dict_type.split('.')[-1]}: DFlash checkpoints must hold the whole drafter "
            "(model.safetensors, Hub-native, what resuming and serving read); set fsdp_state_dict_type: "
            "FULL_STATE_DICT in the accelerate config (the drafter is small: gathering it costs little)."
        )


def fsdp_settings(trainer: Trainer) -> tuple[bool, bool, str, str | None]:
    """`check_fsdp_settings`' arguments read from a built Trainer: FSDP requested (accelerate's FSDP config or
    `--use_fsdp`, or `TrainingArguments.fsdp`), FSDP enabled, accelerate's distributed type, FSDP's state-dict type."""
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    requested = bool(trainer.args.fsdp) or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    kind = str(trainer.accelerator.distributed_type).split(".")[-1]
    return requested, trainer.is_fsdp_enabled, kind, str(plugin.state_dict_type) if plugin is not None else None


def save_unsharded(drafter: DFlashDraftModel, output_dir: str, state_dict: dict, args) -> None:
    """Write `drafter` (an FSDP2-wrapped one) Hub-native with the gathered weights `state_dict`, through a plain
    `DFlashDraftModel` built on the meta device: FSDP2 turns the drafter's class into `FSDPDFlashDraftModel`, a class
    defined in torch, whose own save copies torch's files as the remote code and names that class in `auto_map`."""
    with torch.device("meta"):
        plain = DFlashDraftModel(drafter.config).to(drafter.dtype)
    plain.save_pretrained(output_dir, state_dict=state_dict)
    torch.save(args, os.path.join(output_dir, "training_args.bin"))  # as Trainer._save does


def weighted_selector_losses(drafter, logits, hidden, labels, supervised, weight: float) -> tuple:
    """(weight x DFlash2's K-way selector loss (N,) at the N supervised (B, T) positions, or 0.0 for a DFlash
    drafter or weight 0; the ratios to log: `selector_top_k_recall` and `selector_acc` as (hits, total))."""
    selector = drafter.candidate_selector
    if selector is None or weight == 0:
        return 0.0, {}
    predecessors = block_predecessors(labels, drafter.config.block_size)[supervised]
    draft_ids = drafter.draft_token_ids  # None: the logits span the whole vocabulary
    losses, in_top_k, correct = selector_cross_entropy(
        logits, hidden[supervised], labels[supervised], predecessors, selector, draft_ids
    )
    total = supervised.sum()
    return weight * losses, {"selector_top_k_recall": (in_top_k.sum(), total), "selector_acc": (correct.sum(), total)}


def give_selector_its_learning_rate(optimizer: torch.optim.Optimizer, model, learning_rate: float) -> None:
    """Move a DFlash2 drafter's `candidate_selector` parameters out of the optimizer's groups into groups of
    their own (one per group they left, its other options kept) with peak `learning_rate`; before any step,
    so the scheduler scales them like the rest. No-op without a selector."""
    selected = {id(p) for name, p in model.named_parameters() if name.startswith("candidate_selector.")}
    for group in list(optimizer.param_groups):
        moved = [p for p in group["params"] if id(p) in selected]
        if moved:
            group["params"] = [p for p in group["params"] if id(p) not in selected]
            optimizer.add_param_group(
                {**{k: v for k, v in group.items() if k != "params"}, "params": moved, "lr": learning_rate}
            )
    optimizer.param_groups[:] = [group for group in optimizer.param_groups if group["params"]]


class FSDPAwareTrainer(Trainer):
    """A `Trainer` that refuses FSDP settings that would go wrong (`check_fsdp_settings`, when training starts) and
    saves a `DFlashDraftModel` Hub-native under FSDP2 too (`save_unsharded`)."""

    def train(self, *args, **kwargs):
        check_fsdp_settings(*fsdp_settings(self))
        return super().train(*args, **kwargs)

    def save_drafter(self, output_dir: str | Path) -> None:
        """Save the trained drafter Hub-native into `output_dir`; every process calls it (under FSDP the shards are
        gathered first), the main process writes."""
        if self.is_fsdp_enabled:
            self.save_model(str(output_dir))  # gathers the whole drafter; `_save` writes it on the main process
        elif self.is_world_process_zero():
            self.accelerator.unwrap_model(self.model).save_pretrained(output_dir)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """`Trainer._save`, except for an FSDP2-wrapped drafter (`save_unsharded`)."""
        drafter = self.accelerator.unwrap_model(self.model)
        if not isinstance(drafter, DFlashDraftModel) or type(drafter) is DFlashDraftModel:
            return super()._save(output_dir, state_dict)
        if self.args.should_save:
            save_unsharded(drafter, output_dir or self.args.output_dir, state_dict, self.args)


def online_features_and_teacher(target, target_layer_ids: list[int], inputs: dict, supervised: torch.BoolTensor):
    """(features (B, S, n*Ht), the target's logits (N, V) at the N supervised labels) from one target forward."""
    rows, slots = supervised.nonzero(as_tuple=True)
    label_positions = torch.stack([rows, inputs["block_positions"][rows, slots]], -1)
    return compute_target_features_and_logits(
        target, inputs["input_ids"], target_layer_ids, inputs["attention_mask"], label_positions
    )


def cached_teacher_logits(inputs: dict, supervised: torch.BoolTensor, vocab_size: int, draft_head) -> torch.Tensor:
    """(N, V or N') the target's distribution at the N supervised labels, rebuilt from the feature cache's top-K
    (`top_k_teacher_logits`): the cache's row t predicts token t + 1, so a label at p reads row p - 1."""
    if "teacher_ids" not in inputs:
        raise ValueError(
            "Distilling with feature_mode='offline' needs the target's distribution in the feature cache: re-run "
            "hf-dflash cache-features --teacher-top-k 32 --out <new folder>."
        )
    rows, slots = supervised.nonzero(as_tuple=True)
    positions = inputs["block_positions"][rows, slots] - 1
    return top_k_teacher_logits(
        inputs["teacher_ids"][rows, positions],
        inputs["teacher_logprobs"][rows, positions],
        vocab_size,
        None if draft_head is None else draft_head[1],
    )


class DFlashTrainer(FSDPAwareTrainer):
    """Trains a `DFlashDraftModel` with the DFlash recipe (random anchors in the response, the next block_size - 1
    positions masked, the loss weighted by exp(-(k - 1) / gamma)).

    `model` is the drafter (trainable); `target` is frozen: in `feature_mode="online"` it runs once per
    step to produce the features, in "offline" the batches carry `target_hidden_states` and the target
    only lends its embedding and LM head. The loss Σ w·CE / Σ w is normalised over the whole
    accumulated batch and all processes (`_get_num_items_in_batch` sums the blocks' weights).
    Logged metrics: loss, per-slot accuracy `acc_k`, and `tau` (expected acceptance length).
    """

    _tag_names = list(CARD_TAGS)  # the tags of the model card (`create_model_card`)
    _name = "DFlash"

    def __init__(
        self,
        model: DFlashDraftModel,
        args: DFlashTrainingArguments,
        target: PreTrainedModel,
        data_collator=None,
        **kwargs,
    ):
        if not isinstance(args, DFlashTrainingArguments):
            raise TypeError(f"args must be DFlashTrainingArguments, got {type(args).__name__}.")
        if model.config.block_size != args.block_size:
            raise ValueError(
                f"args.block_size={args.block_size} differs from the drafter's block_size={model.config.block_size}."
            )
        check_training_pairing(target, model)
        if data_collator is None:
            data_collator = DFlashDataCollator(
                block_size=args.block_size,
                num_anchors=args.num_anchors,
                mask_token_id=model.config.mask_token_id,
                gamma=args.loss_decay_gamma,
                pad_token_id=target.config.get_text_config().pad_token_id or 0,
                anchor_decay_tokens=args.anchor_decay_tokens,
            )
        super().__init__(model=model, args=args, data_collator=data_collator, **kwargs)
        target.requires_grad_(False)
        if getattr(target, "hf_device_map", None) is None and target.device != self.args.device:
            target = target.to(self.args.device)  # the Trainer moves the drafter; the frozen target must follow
        self.target = target.eval()
        self.target_layer_ids = list(model.config.target_layer_ids)
        self.model_accepts_loss_kwargs = True  # compute_loss uses num_items_in_batch
        self.loss_is_scaled_for_ga = True
        self._metric_sums: dict[str, dict[str, torch.Tensor]] = {"train": {}, "eval": {}}

    def create_optimizer(self, model=None) -> torch.optim.Optimizer:
        optimizer = super().create_optimizer(model)
        if self.args.selector_learning_rate is not None:
            give_selector_its_learning_rate(optimizer, self.model, self.args.selector_learning_rate)
        return optimizer

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> torch.Tensor:
        """Σ of the loss weights over the accumulated batch (and over processes when averaging)."""
        total = sum(batch["loss_weights"].sum() for batch in batch_samples).to(device)
        if self.args.average_tokens_across_devices and self.args.world_size > 1:
            total = self.accelerator.gather(total).sum()
        return total

    def target_features(self, inputs: dict) -> torch.Tensor:
        """(B, S, n*Ht) features of the batch: cached (offline) or from one target forward (online)."""
        if self.args.feature_mode == "offline":
            if "target_hidden_states" not in inputs:
                raise ValueError("feature_mode='offline' needs batches with target_hidden_states (cached features).")
            return inputs["target_hidden_states"]
        return compute_target_features(
            self.target, inputs["input_ids"], self.target_layer_ids, inputs["attention_mask"]
        )

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        drafter = self.accelerator.unwrap_model(model)
        weights = inputs["loss_weights"]
        supervised = weights > 0
        if self.args.loss_type != "ce" and self.args.feature_mode == "online":
            features, teacher_logits = online_features_and_teacher(
                self.target, self.target_layer_ids, inputs, supervised
            )
        else:  # the teacher, if any, comes from the feature cache below
            features, teacher_logits = self.target_features(inputs), None
        features = features.to(next(drafter.parameters()).dtype)
        hidden = dflash_training_forward(model, self.target.get_input_embeddings(), inputs, features, drafter.config)
        lm_head = self.target.get_output_embeddings()
        draft_head = None
        if drafter.config.draft_vocab_size is not None:
            draft_head = (drafter.draft_head(lm_head).weight, target_to_draft_index(drafter.t2d))
            self._count("draft_vocab_miss", (supervised & ~drafter.t2d[inputs["labels"]]).sum(), supervised.sum())
        config = drafter.config  # the logits as served: z-lab's output transforms apply (no-ops by default)
        logits = selected_logits(hidden, lm_head, supervised, draft_head)  # (N, V'): read by every loss
        logits = transform_logits(logits, config.output_multiplier, config.final_logit_softcapping)
        losses, inside, correct = position_cross_entropy(
            hidden, lm_head, inputs["labels"], supervised, draft_head, logits
        )
        if teacher_logits is None and self.args.loss_type != "ce":
            teacher_logits = cached_teacher_logits(inputs, supervised, lm_head.weight.shape[0], draft_head)
        position_losses = losses  # (N,) what each supervised position is trained on: CE, or CE and KL mixed
        if teacher_logits is not None:
            share = 1.0 if self.args.loss_type == "kl" else self.args.distill_weight
            position_losses = (1 - share) * losses + share * position_kl(logits, teacher_logits, draft_head)
        selector_losses, ratios = weighted_selector_losses(
            drafter, logits, hidden, inputs["labels"], supervised, self.args.selector_loss_weight
        )
        for name, (hits, total) in ratios.items():
            self._count(name, hits, total)
        if self.args.position_weighting == "dpace":
            # Weights from this micro-batch's confidence in its labels (whatever the loss), normalised here.
            dpace = dpace_block_weights(losses, inside, supervised, drafter.config.block_size, self.args.dpace_alpha)
            loss = ((position_losses + selector_losses) * dpace[supervised]).sum() / dpace.sum().clamp_min(1e-6)
            loss = loss / self.args.gradient_accumulation_steps
            self._accumulate_metrics(correct, supervised, drafter.config.block_size)
            return (loss, hidden) if return_outputs else loss
        loss_sum = ((position_losses + selector_losses) * weights[supervised]).sum()
        normaliser = num_items_in_batch if num_items_in_batch is not None else weights.sum()
        loss = loss_sum / normaliser.clamp_min(1e-6)
        if self.args.average_tokens_across_devices and self.args.world_size > 1:
            loss = loss * self.accelerator.num_processes  # DDP averages gradients over processes
        self._accumulate_metrics(correct, supervised, drafter.config.block_size)
        return (loss, hidden) if return_outputs else loss

    def create_model_card(self, model_name: str | None = None, license: str = "apache-2.0", **kwargs) -> None:
        """Write the DFlash card (`hf_dflash.hub_cards` template, tagged with `_tag_names`) instead of
        Transformers' generic draft: drafter config, target as `base_model`, and this run's
        `training_record.json` when a `TrainingRecordCallback` wrote one. `push_to_hub` uploads it."""
        if not self.is_world_process_zero():
            return
        output_dir = Path(self.args.output_dir)
        record = output_dir / TRAINING_RECORD_NAME
        target_id = self.args.target_name_or_path or self.target.config.name_or_path or "unknown-target"
        spec = KNOWN_TARGETS.get(target_id)
        card = render_model_card(
            self.accelerator.unwrap_model(self.model).config,
            target_id=spec.hub_id if spec else target_id,
            repo_id=self.args.hub_model_id,
            training_record=record if record.is_file() else None,
            license=license,
        )
        card.data.tags = sorted(set(card.data.tags or []) | set(self._tag_names))
        card.save(output_dir / "README.md")

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """The loss, acc_k and uniform-anchor τ of `Trainer.evaluate`, plus `<prefix>_served_tau`: the τ
        `generate` would serve on the first `args.eval_served_tau` held-out samples (see consistency.py)."""
        metrics = super().evaluate(eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        count = min(self.args.eval_served_tau, len(dataset)) if dataset is not None else 0
        if count and self.is_world_process_zero():
            drafter = self.accelerator.unwrap_model(self.model)
            estimate = served_tau_estimate(drafter, self.target, [dataset[i] for i in range(count)])
            served = {
                f"{metric_key_prefix}_served_tau": round(estimate.served_tau, 4),
                f"{metric_key_prefix}_all_anchor_tau": round(estimate.uniform_tau, 4),
            }
            metrics.update(served)
            self.log(served)
        return metrics

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Evaluation = the training loss and metrics on held-out data (no logits are gathered)."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def _count(self, name: str, hits: torch.Tensor, total: torch.Tensor) -> None:
        """Accumulate a ratio metric (logged as hits / total, e.g. draft_vocab_miss)."""
        split = "train" if self.model.training else "eval"
        sums = self._metric_sums[split].setdefault("ratios", {})
        previous = sums.get(name, torch.zeros(2))
        sums[name] = previous + torch.stack([hits.detach().float().cpu(), total.detach().float().cpu()])

    def _accumulate_metrics(self, correct: torch.Tensor, supervised: torch.Tensor, block_size: int) -> None:
        split = "train" if self.model.training else "eval"
        right, seen, tau = acceptance_estimate(correct.detach(), supervised, block_size)
        sums = self._metric_sums[split]
        for name, value in (("correct", right), ("supervised", seen), ("tau", tau)):
            sums[name] = sums.get(name, 0) + value.cpu()

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add per-slot accuracy `acc_k` and `tau` accumulated since the last log (summed over processes)."""
        split = "eval" if any(key.startswith("eval_") for key in logs) else "train"
        sums = self._metric_sums[split]
        ratios = sums.pop("ratios", {})
        for name, (hits, total) in ratios.items():
            if self.args.world_size > 1:
                hits, total = self.accelerator.reduce(
                    torch.stack([hits, total]).to(self.args.device), reduction="sum"
                ).cpu()
            logs[("eval_" if split == "eval" else "") + name] = round(float(hits / total.clamp_min(1)), 4)
        if "correct" in sums:
            packed = torch.cat([sums["correct"], sums["supervised"], sums["tau"]]).to(self.args.device)
            packed = self.accelerator.reduce(packed, reduction="sum") if self.args.world_size > 1 else packed
            packed = packed.cpu()
            slots = (len(packed) - 2) // 2
            prefix = "eval_" if split == "eval" else ""
            accuracy = packed[:slots] / packed[slots : 2 * slots].clamp_min(1)
            logs.update({f"{prefix}acc_{k + 1}": round(float(a), 4) for k, a in enumerate(accuracy)})
            logs[f"{prefix}tau"] = round(float(packed[-2] / packed[-1].clamp_min(1)), 4)
            self._metric_sums[split] = {}
        super().log(logs, start_time)
