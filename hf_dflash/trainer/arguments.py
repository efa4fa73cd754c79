"""`DFlashTrainingArguments`: `TrainingArguments` with the DFlash recipe's knobs and paper defaults."""

from dataclasses import dataclass, field

from transformers import TrainingArguments

from ..modeling_dflash import DFlashConfig
from .maths import default_decay_gamma

LOSS_TYPES = ("ce", "kl", "ce+kl")
POSITION_WEIGHTINGS = ("decay", "dpace")
FEATURE_MODES = ("online", "offline")


@dataclass
class DFlashTrainingArguments(TrainingArguments):
    """The paper's defaults: AdamW, lr 6e-4, cosine schedule, 4% warm-up, clip 1.0, 6 epochs."""

    block_size: int = field(
        default=DFlashConfig.block_size,  # the drafter config's default (the paper's 16): one number for both
        metadata={"help": "Block size drafted per round (anchor + bs-1 masks)."},
    )
    num_anchors: int = field(
        default=512, metadata={"help": "Anchors (blocks) drawn per sequence each step, without replacement."}
    )
    anchor_decay_tokens: float = field(
        default=0.0,
        metadata={
            "help": "0: anchors drawn uniformly over the replies (the paper). N > 0: a position d tokens into its "
            "reply is drawn with weight 1 / (1 + d / N), so the first tokens of each reply, where serving's "
            "first rounds run with the least context, get more anchors."
        },
    )
    loss_decay_gamma: float | None = field(
        default=None,
        metadata={
            "help": "Slot weight exp(-(k-1)/gamma). Default: 7 for bs 16, 5 for bs 10, 4 for bs 8, else 7*bs/16."
        },
    )
    loss_type: str = field(
        default="ce",
        metadata={
            "help": "'ce': cross-entropy on the target's own tokens; 'kl': distil the target's distribution at each "
            "label position, KL(p_target || q_draft) (online: from the target's forward; offline: from a feature "
            "cache made with `cache-features --teacher-top-k K`); 'ce+kl': (1 - distill_weight) * CE + "
            "distill_weight * KL."
        },
    )
    distill_weight: float = field(
        default=0.5, metadata={"help": "loss_type 'ce+kl': the KL's share of each position's loss, in [0, 1]."}
    )
    position_weighting: str = field(
        default="decay",
        metadata={
            "help": "'decay': slot k weighted exp(-(k-1)/gamma) (the paper); 'dpace': D-PACE (arXiv 2605.18810), "
            "each slot weighted by its share of the expected accepted length under the drafter's current "
            "confidence in the label (whatever the loss; normalised per micro-batch)."
        },
    )
    dpace_alpha: float = field(
        default=0.5, metadata={"help": "D-PACE confidence smoothing q~ = (1 - alpha) q + alpha, in (0, 1]."}
    )
    selector_loss_weight: float = field(
        default=1.0,
        metadata={
            "help": "DFlash2 drafters: weight of the candidate selector's K-way cross-entropy added to the DFlash "
            "loss (teacher-forced predecessors, the label injected when missing from the top-K); 0 trains "
            "the selector not at all. Ignored for DFlash drafters."
        },
    )
    selector_learning_rate: float | None = field(
        default=None,
        metadata={
            "help": "DFlash2 drafters: the peak learning rate of the candidate selector's weights (codebooks and "
            "hidden projection), which start from identity while the rest is trained; None: learning_rate."
        },
    )
    feature_mode: str = field(
        default="online",
        metadata={"help": "'online': run the frozen target in each step; 'offline': read cached features."},
    )
    eval_served_tau: int = field(
        default=16,
        metadata={
            "help": "At each evaluation, also estimate the τ serving would get on the first N held-out samples "
            "(anchors walked p -> p + τ(p) as generate visits them; logged as eval_served_tau next to the "
            "uniform-anchor eval_tau). 0 turns it off."
        },
    )
    target_name_or_path: str | None = field(
        default=None, metadata={"help": "Target model (a known name such as smollm2-135m-instruct, or a path)."}
    )
    learning_rate: float = field(default=6e-4, metadata={"help": "Peak AdamW learning rate (paper: 6e-4)."})
    lr_scheduler_type: str = field(default="cosine", metadata={"help": "Learning-rate schedule (paper: cosine)."})
    warmup_steps: float = field(default=0.04, metadata={"help": "Warm-up steps, or a ratio in [0, 1) (paper: 4%)."})
    num_train_epochs: float = field(default=6.0, metadata={"help": "Epochs (paper: 6)."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Gradient clipping (paper: 1.0)."})
    ddp_find_unused_parameters: bool | None = field(
        default=False, metadata={"help": "Every drafter weight is used in each step: no unused-parameter search."}
    )
    remove_unused_columns: bool = field(
        default=False, metadata={"help": "Must stay False: the DFlash collator needs loss_mask and features."}
    )

    def __post_init__(self):
        super().__post_init__()
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}.")
        if self.num_anchors < 1:
            raise ValueError(f"num_anchors must be >= 1, got {self.num_anchors}.")
        if self.feature_mode not in FEATURE_MODES:
            raise ValueError(f"feature_mode must be one of {FEATURE_MODES}, got {self.feature_mode!r}.")
        if not self.anchor_decay_tokens >= 0:
            raise ValueError(
                f"anchor_decay_tokens must be >= 0 (0 = uniform anchors), got {self.anchor_decay_tokens!r}."
            )
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}.")
        if self.position_weighting not in POSITION_WEIGHTINGS:
            raise ValueError(
                f"position_weighting must be one of {POSITION_WEIGHTINGS}, got {self.position_weighting!r}."
            )
        if not 0 <= self.distill_weight <= 1:
            raise ValueError(
                f"distill_weight must be in [0, 1] (the KL's share of 'ce+kl'), got {self.distill_weight!r}."
            )
        if self.selector_learning_rate is not None and not self.selector_learning_rate > 0:
            raise ValueError(f"selector_learning_rate must be > 0 (or None), got {self.selector_learning_rate!r}.")
        if not self.selector_loss_weight >= 0:
            raise ValueError(f"selector_loss_weight must be >= 0, got {self.selector_loss_weight!r}.")
        if not 0 < self.dpace_alpha <= 1:
            raise ValueError(f"dpace_alpha must be in (0, 1], got {self.dpace_alpha!r}.")
        if self.remove_unused_columns:
            raise ValueError("remove_unused_columns=True would drop loss_mask; DFlash training needs False.")
        if self.loss_decay_gamma is None:
            self.loss_decay_gamma = default_decay_gamma(self.block_size)
        if self.loss_decay_gamma <= 0:
            raise ValueError(f"loss_decay_gamma must be > 0, got {self.loss_decay_gamma}.")
