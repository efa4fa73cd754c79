"""What a pruned draft vocabulary saves: draft-pass and training-step cost, full vs pruned, SmolLM2-135M.

For each draft vocabulary size (full = all 49,152 rows of the target's LM head), the same random drafter
(same seed) is timed on:
  - one draft pass at serving time: block of 16 over a prefilled context (drafter forward + logits);
  - one training step: target features, packed multi-block forward, loss over the (sub)vocabulary,
    backward and AdamW step, on a fixed batch of real regenerated chats.
The subset is the most frequent supervised tokens of the training part of the packed data; its
coverage of the held-out part (the last 10%) is reported too. Sizes are timed interleaved, `--reps`
times each, and the median is reported. Prints a table and writes JSON.

    python benchmarks/training/draft_vocab_cost.py --data data/smollm2-135m-instruct --sizes full,8192,4096 \
        --layers 5 --reps 5 --drafter models/smollm2-135m-instruct-dflash --out out/draft_vocab_cost.json

With --drafter, a trained full-vocabulary drafter is also restricted to each subset (no retraining) and
its held-out τ is estimated with the serving walk (`served_tau_estimate`): what pruning alone costs.
"""

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from transformers.cache_utils import DFlashCache

from hf_dflash import DFlashConfig, DFlashDraftModel
from hf_dflash.data.packed import PackedDataset
from hf_dflash.dtypes import describe_dtype
from hf_dflash.target_features import compute_target_features
from hf_dflash.targets import load_target
from hf_dflash.trainer.collator import DFlashDataCollator
from hf_dflash.trainer.draft_vocab import select_draft_vocab, supervised_token_counts
from hf_dflash.trainer.forward import dflash_training_forward
from hf_dflash.trainer.maths import target_to_draft_index, weighted_cross_entropy_sum


def restrict_vocab(drafter: DFlashDraftModel, size: int | None, ids) -> DFlashDraftModel:
    """A copy of a trained full-vocabulary drafter that drafts over `ids` only (same weights)."""
    if size is None:
        return drafter
    config = type(drafter.config).from_dict({**drafter.config.to_dict(), "draft_vocab_size": size})
    restricted = DFlashDraftModel(config)
    restricted.load_state_dict(drafter.state_dict(), strict=False)
    restricted.set_draft_vocab(ids)
    return restricted.eval()


def build(target, tokenizer, layers: int, block_size: int, size: int | None, ids, seed: int) -> DFlashDraftModel:
    config = DFlashConfig.from_target_config(
        target.config, num_hidden_layers=layers, block_size=block_size, tokenizer=tokenizer, draft_vocab_size=size
    )
    torch.manual_seed(seed)
    drafter = DFlashDraftModel(config)
    if size is not None:
        drafter.set_draft_vocab(ids)
    return drafter


@torch.no_grad()
def draft_pass_seconds(drafter, target, features: torch.Tensor, block_size: int) -> float:
    """One serving-time draft pass: context features already cached, a fresh block of `block_size`."""
    embedding, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    cache = DFlashCache(config=drafter.config)
    context = features.shape[1]
    drafter(
        noise_embeds=embedding(torch.full((1, block_size), drafter.config.mask_token_id)),
        context_hidden_states=features,
        position_ids=torch.arange(context + block_size)[None],
        cache=cache,
    )
    cache.crop(-block_size)
    block = torch.full((1, block_size), drafter.config.mask_token_id)
    start = time.perf_counter()
    hidden = drafter(
        noise_embeds=embedding(block),
        context_hidden_states=features[:, :0],
        position_ids=torch.arange(context, context + block_size)[None],
        cache=cache,
    ).last_hidden_state
    drafter.draft_logits(hidden[:, 1:], lm_head).argmax(-1)
    return time.perf_counter() - start


def training_step_seconds(drafter, target, batch: dict, optimizer) -> float:
    start = time.perf_counter()
    with torch.no_grad():
        features = compute_target_features(
            target, batch["input_ids"], drafter.config.target_layer_ids, batch["attention_mask"]
        )
    hidden = dflash_training_forward(drafter, target.get_input_embeddings(), batch, features.float(), drafter.config)
    lm_head = target.get_output_embeddings()
    head = None
    if drafter.config.draft_vocab_size is not None:
        head = (drafter.draft_head(lm_head).weight, target_to_draft_index(drafter.t2d))
    weights = batch["loss_weights"]
    loss_sum, _ = weighted_cross_entropy_sum(hidden, lm_head, batch["labels"], weights, head)
    (loss_sum / weights.sum()).backward()
    optimizer.step()
    optimizer.zero_grad()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="data/smollm2-135m-instruct")
    parser.add_argument("--sizes", default="full,8192,4096", help="comma-separated: full or a size")
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-anchors", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--context", type=int, default=256, help="context tokens before the drafted block")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dtype", default="auto", help="target dtype (the drafter trains in float32)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--drafter", default=None, help="also: this trained drafter's held-out τ (walk) per subset")
    parser.add_argument("--tau-samples", type=int, default=32, help="held-out chats for the τ of --drafter")
    parser.add_argument("--out", default="out/draft_vocab_cost.json")
    args = parser.parse_args()

    target, tokenizer = load_target(dtype=args.dtype)
    data = PackedDataset(args.data, vocab_size=target.config.vocab_size)
    split = int(len(data) * 0.9)
    vocab = target.config.vocab_size
    train_counts = supervised_token_counts((data[i] for i in range(split)), vocab)
    held_out_counts = supervised_token_counts((data[i] for i in range(split, len(data))), vocab)
    sizes = [None if s == "full" else int(s) for s in args.sizes.split(",")]
    eos = [tokenizer.eos_token_id]
    subsets = {size: None if size is None else select_draft_vocab(train_counts, size, always=eos) for size in sizes}

    collator = DFlashDataCollator(
        block_size=args.block_size,
        num_anchors=args.num_anchors,
        mask_token_id=0,
        gamma=7.0,
        generator=torch.Generator().manual_seed(args.seed),
    )
    samples = [data[i] for i in range(args.batch_size)]
    drafters = {
        size: build(target, tokenizer, args.layers, args.block_size, size, subsets[size], args.seed) for size in sizes
    }
    collator.mask_token_id = drafters[sizes[0]].config.mask_token_id
    batch = collator(samples)
    optimizers = {size: torch.optim.AdamW(d.parameters(), lr=1e-6) for size, d in drafters.items()}
    with torch.no_grad():
        ids = torch.tensor([data[0]["input_ids"] * 4])[:, : args.context]
        features = compute_target_features(
            target, ids, drafters[sizes[0]].config.target_layer_ids, torch.ones_like(ids)
        )
    for size in sizes:  # warm-up
        draft_pass_seconds(drafters[size].to(target.dtype), target, features, args.block_size)
        drafters[size].float()
        training_step_seconds(drafters[size], target, batch, optimizers[size])
    draft_times = {size: [] for size in sizes}
    step_times = {size: [] for size in sizes}
    for _ in range(args.reps):
        for size in sizes:
            drafter = drafters[size].to(target.dtype)
            draft_times[size].append(draft_pass_seconds(drafter, target, features, args.block_size))
            drafter.float()
            step_times[size].append(training_step_seconds(drafter, target, batch, optimizers[size]))

    walk = {}
    if args.drafter:  # a trained drafter restricted to each subset, no retraining: τ full vs pruned
        from hf_dflash.checkpoints import load_drafter
        from hf_dflash.trainer.consistency import served_tau_estimate

        trained = load_drafter(args.drafter)
        held_out = [data[i] for i in range(len(data) - args.tau_samples, len(data))]
        for size in sizes:
            restricted = restrict_vocab(trained, size, subsets[size]).to(target.dtype)
            walk[size] = served_tau_estimate(restricted, target, held_out).served_tau
    rows = []
    for size in sizes:
        ids = subsets[size]
        held = 1.0 if ids is None else float(held_out_counts[ids].sum() / held_out_counts.sum().clamp_min(1))
        rows.append(
            {
                "draft_vocab": "full" if size is None else size,
                "held_out_coverage": round(held, 4),
                "draft_pass_ms": round(1000 * statistics.median(draft_times[size]), 2),
                "training_step_s": round(statistics.median(step_times[size]), 3),
                **({"served_tau_walk": round(walk[size], 4)} if walk else {}),
            }
        )
    base = rows[0]
    print(
        f"SmolLM2-135M target in {describe_dtype(args.dtype)}; drafter {args.layers} layers, block {args.block_size}; "
        f"train step: batch {args.batch_size}, {args.num_anchors} anchors, {batch['input_ids'].shape[1]} tokens"
    )
    print(
        f"{'draft vocab':>12} {'held-out cov':>12} {'draft pass ms':>14} {'vs full':>8} {'train step s':>13} {'vs full':>8}"
    )
    for row in rows:
        print(
            f"{str(row['draft_vocab']):>12} {row['held_out_coverage']:>12.4f} {row['draft_pass_ms']:>14.2f} "
            f"{row['draft_pass_ms'] / base['draft_pass_ms']:>7.2f}x {row['training_step_s']:>13.3f} "
            f"{row['training_step_s'] / base['training_step_s']:>7.2f}x"
            + (
                f"   τ (walk, {args.drafter} restricted) {row['served_tau_walk']:.3f} "
                f"({100 * (row['served_tau_walk'] / base['served_tau_walk'] - 1):+.1f}%)"
                if walk
                else ""
            )
        )
    result = {
        "settings": vars(args),
        "machine": {
            "processor": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
            "dtype": describe_dtype(args.dtype),
        },
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
