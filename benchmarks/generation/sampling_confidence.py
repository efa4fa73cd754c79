"""Which confidence prices a sampled draft best? The "confidence" policy verifies the prefix of a round's drafts that
maximises expected committed tokens per second, from each draft's chance of being accepted as the drafter sees it.
Greedy, that chance is the drafter's probability of its argmax. Sampling (`generate(do_sample=True)`), a draft x ~ q
is accepted with min(1, p(x) / q(x)), p the target's distribution, unknown before the verification; its expectation
over x is sum_v min(p, q). This script scores candidate stand-ins computed from q alone, on held-out chats:

    sampled    q(x), the drafter's probability of the token it drew (what the policy used first)
    collision  sum_v q_v^2, the expectation of q(x) over x ~ q (the same signal without the draw's noise)
    max        max_v q_v, the drafter's confidence in its favourite
    all        1: verify every draft (the trained block)
    oracle     min(1, p(x) / q(x)) itself (an upper bound no policy can reach)

Each round is replayed as the loop plays it: drafts x ~ q at every slot of an anchor's block, the policy's prefix
choice (`best_prefix`) with its online calibration (`DraftCalibration`), and the round's expected committed tokens
1 + sum_{i<=m} prod_{j<=i} min(1, p(x_j) / q(x_j)) over its price (drafter pass + verification of m + 1 tokens).
Prices come from `--verify-ms` (seconds of a verification over 1 and over `block_size` tokens, linear between) and
`--drafter-ms`; several scenarios compare a flat CPU price with steeper ones (batches, larger targets). As the
held-out sampling τ does, every slot's p and q are read with the chat's own tokens before it.

    python benchmarks/generation/sampling_confidence.py models/smollm2-135m-instruct-dflash \\
        --eval-part regen-bf16-part21 --samples 16 --temperatures 0.7,1.0 --out out/sampling_confidence.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from hf_dflash.checkpoints import load_drafter
from hf_dflash.generation.policies.confidence import DraftCalibration, best_prefix, reach_probabilities
from hf_dflash.targets import load_target
from hf_dflash.trainer.heldout import held_out_samples
from hf_dflash.trainer.sampling_tau import slot_distributions

PREDICTORS = ("sampled", "collision", "max", "all", "oracle")
# scenario -> (verification ms over 1 and over block_size tokens, drafter pass ms): a quiet 2-core Zen 4, SmolLM2
# bf16, batch 1 (the shipped drafter's test prices), and two steeper verification curves
SCENARIOS = {"cpu-batch-1": (2.4, 2.8, 1.0), "verify-x2": (2.4, 4.8, 1.0), "verify-x4": (2.4, 9.6, 1.0)}


def round_features(p: torch.Tensor, q: torch.Tensor, drafted: torch.Tensor, generator: torch.Generator):
    """Draw x ~ q at every slot and return (acceptance (A, L), {predictor: (A, L)}) for p, q (A, L, V) and drafted
    (A, L): acceptance min(1, p(x)/q(x)) (0 past the reply), each predictor's stand-in for it (0 past the reply)."""
    x = torch.multinomial(q.flatten(0, 1), 1, generator=generator).view(q.shape[:2])  # (A, L)
    q_x, p_x = q.gather(-1, x[..., None])[..., 0], p.gather(-1, x[..., None])[..., 0]
    acceptance = (p_x / q_x).clamp(max=1.0) * drafted
    features = {
        "sampled": q_x,
        "collision": q.square().sum(-1),
        "max": q.max(-1).values,
        "all": torch.ones_like(q_x),
        "oracle": acceptance,
    }
    return acceptance, {name: value * drafted for name, value in features.items()}


def replay(
    acceptance: torch.Tensor,
    confidence: torch.Tensor,
    verify: torch.Tensor,
    drafter_seconds: float,
    calibration: DraftCalibration,
    fixed: bool = False,
) -> tuple[float, float, float]:
    """Play the rounds of acceptance / confidence (A, L) in order with the policy's prefix choice (`fixed`: always
    every drafted slot). Returns (expected committed tokens, seconds, mean drafts verified)."""
    tokens = seconds = verified = 0.0
    for accept, confident in zip(acceptance, confidence):
        if fixed:
            m = int((confident > 0).sum())
        else:
            reach = reach_probabilities(confident[None])
            m = best_prefix(reach, verify, calibration.factor)
            calibration.expected = float(reach[0, :m].sum())
        survival = accept[:m].to(torch.float64).cumprod(0)
        committed = 1.0 + float(survival.sum())
        if not fixed:
            calibration.observe(committed - 1.0)
        tokens += committed
        seconds += drafter_seconds + float(verify[m])
        verified += m
    return tokens, seconds, verified


def score_drafter(drafter, target, samples: list[dict], temperatures: list[float], seed: int) -> dict:
    """{T: {"slots", "mean_acceptance", "predictors": {name: {"mean", "correlation", "scenarios": {scenario:
    {"tokens_per_round", "drafts_verified", "x_plain"}}}}}} of one drafter on the held-out samples."""
    block, generator = drafter.config.block_size, torch.Generator().manual_seed(seed)
    cells = [(t, name, scenario) for t in temperatures for name in PREDICTORS for scenario in SCENARIOS]
    totals = {cell: [0.0, 0.0, 0.0, 0] for cell in cells}  # tokens, seconds, drafts verified, rounds
    calibrations = {cell: DraftCalibration() for cell in cells}
    slots = {t: {"acceptance": [], **{name: [] for name in PREDICTORS}} for t in temperatures}
    for t, p, q, drafted in slot_distributions(drafter, target, samples, temperatures):
        acceptance, features = round_features(p, q, drafted, generator)
        keep = drafted.bool()
        slots[t]["acceptance"].append(acceptance[keep])
        for name in PREDICTORS:
            slots[t][name].append(features[name][keep])
        for scenario, (one, full, drafting) in SCENARIOS.items():
            verify = torch.linspace(one, full, block) / 1000  # (block,) seconds verifying m = 0..block-1 drafts
            for name in PREDICTORS:
                cell = (t, name, scenario)
                played = replay(acceptance, features[name], verify, drafting / 1000, calibrations[cell], name == "all")
                totals[cell] = [*map(sum, zip(totals[cell], (*played, len(acceptance))))]
    rows = {}
    for t in temperatures:
        accepted = torch.cat(slots[t]["acceptance"])
        table = {}
        for name in PREDICTORS:
            feature = torch.cat(slots[t][name])
            scenarios = {}
            for scenario, (one, _, _) in SCENARIOS.items():
                tokens, seconds, verified, rounds = totals[(t, name, scenario)]
                scenarios[scenario] = {
                    "tokens_per_round": round(tokens / rounds, 4),
                    "drafts_verified": round(verified / rounds, 3),
                    "x_plain": round(tokens / seconds / (1000 / one), 4),
                }
            correlation = float(torch.corrcoef(torch.stack([feature, accepted]))[0, 1]) if name != "all" else 0.0
            table[name] = {
                "mean": round(float(feature.mean()), 4),
                "correlation": round(correlation, 4),
                "scenarios": scenarios,
            }
        rows[str(t)] = {
            "slots": len(accepted),
            "mean_acceptance": round(float(accepted.mean()), 4),
            "predictors": table,
        }
    return rows


def print_tables(path: str, rows: dict) -> None:
    for t, row in rows.items():
        print(f"\n{path}, T = {t}: {row['slots']} slots, mean acceptance {row['mean_acceptance']:.3f}")
        print(
            "| predictor | mean | corr. | "
            + " | ".join(f"{s}: tok/round, drafts, × plain" for s in SCENARIOS)
            + " |\n|---|---|---|"
            + "---|" * len(SCENARIOS)
        )
        for name, cell in row["predictors"].items():
            shown = [
                f"{c['tokens_per_round']:.3f}, {c['drafts_verified']:.2f}, {c['x_plain']:.3f}"
                for c in cell["scenarios"].values()
            ]
            print(f"| {name} | {cell['mean']:.3f} | {cell['correlation']:.3f} | " + " | ".join(shown) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("drafters", nargs="+")
    parser.add_argument("--data", default="data/smollm2-135m-instruct")
    parser.add_argument("--eval-part", default=None)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--temperatures", default="0.7,1.0")
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="out/sampling_confidence.json")
    args = parser.parse_args()
    temperatures = [float(t) for t in args.temperatures.split(",") if t]
    samples = held_out_samples(args.data, args.samples, args.eval_part)
    target, _ = load_target(args.target, dtype=args.dtype)
    results = []
    for path in args.drafters:
        drafter = load_drafter(path).to(target.dtype).eval()
        rows = score_drafter(drafter, target, samples, temperatures, args.seed)
        print_tables(path, rows)
        results.append({"drafter": path, "temperatures": rows})
    settings = {
        **vars(args),
        "dtype": str(target.dtype),
        "scenarios": SCENARIOS,
        "sample_ids": [s["id"] for s in samples],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"settings": settings, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
