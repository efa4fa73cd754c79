#!/usr/bin/env bash
# One lent-GPU session, on the device machine, from the repository root (see scripts/gpu_kit.py):
#   1. join .gpu/part-* and install its wheels into /tmp/site (the image's PyTorch stays);
#   2. train drafter variants from the committed data (scripts/train_on_gpu.py, --eval-part: the fixed
#      held-out chats, so every variant and v1 are compared on the same set);
#   3. `hf-dflash bench` on CUDA with the best variant (by served-walk τ) on every kit prompt set;
#   4. into $OUT (8 files at most, 16 MiB each): results.json, session.log, the best drafter as tar parts.
# Settings (environment): TRAIN_SECONDS (210), SESSION_SECONDS (560), VARIANTS (space-separated --variant values; the default three
# each get a third of the GPU: v1's recipe on the larger data; with a pruned vocabulary and block 8 (both
# gained held-out τ per CPU-hour in benchmarks/training/recipe_comparison.py); with KL distillation;
# depth was settled by v1's run, L5 over L3), TRAIN_ARGS (more train_on_gpu.py options), DEVICE (cuda),
# BENCH_METHODS (all), BENCH_TOKENS (256), PYTHON (python3).
# Rehearse it on CPU (the kit made by gpu_kit.py, a fresh target cache, tiny settings):
#   OUT=/tmp/gpu_out DEVICE=cpu PYTHON=.venv/bin/python HF_DFLASH_CACHE=/tmp/fresh TRAIN_SECONDS=150 \
#   VARIANTS=L1:num_hidden_layers=1 TRAIN_ARGS="--train-batch-size 2 --num-anchors 8" \
#   BENCH_METHODS=plain,dflash BENCH_TOKENS=16 bash scripts/gpu_session.sh
set -euo pipefail
TRAIN_SECONDS=${TRAIN_SECONDS:-210}  # + ~1 min of evaluations, then the bench: all inside one 600 s call
SESSION_SECONDS=${SESSION_SECONDS:-560}  # no bench set is started later than 60 s before this
VARIANTS=${VARIANTS:-"L5:num_hidden_layers=5 L5-V8k-B8:num_hidden_layers=5,draft_vocab_size=8192,block_size=8,training.block_size=8 L5-kl:num_hidden_layers=5,training.loss_type=kl"}
TRAIN_ARGS=${TRAIN_ARGS:-}
DEVICE=${DEVICE:-cuda}
BENCH_METHODS=${BENCH_METHODS:-plain,dflash,builtin,lookup,hybrid,plain-alt}
BENCH_TOKENS=${BENCH_TOKENS:-256}
PYTHON=${PYTHON:-python3}
OUT=${OUT:?set OUT to the folder whose files come back}
KIT=${KIT:-/tmp/kit}
RUN=${RUN:-/tmp/run}
mkdir -p "$OUT" "$KIT"
deadline=$(( $(date +%s) + SESSION_SECONDS ))
exec > >(tee "$OUT/session.log") 2>&1
stamp() { echo "[$(date +%T)] $*"; }

stamp "joining $(ls .gpu/part-* | wc -l) kit parts"
cat .gpu/part-* | tar -x -C "$KIT"
$PYTHON -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$KIT"/wheels/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
$PYTHON -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"

stamp "training for ${TRAIN_SECONDS} s: ${VARIANTS}"
variant_args=()
for variant in $VARIANTS; do variant_args+=(--variant "$variant"); done
$PYTHON scripts/train_on_gpu.py --data data/smollm2-135m-instruct --eval-part regen-bf16-part2 --out "$RUN" \
    --device "$DEVICE" --train-seconds "$TRAIN_SECONDS" $TRAIN_ARGS "${variant_args[@]}"

best=$($PYTHON - "$RUN" <<'PY'
import json, sys
from pathlib import Path
logs = [json.loads(p.read_text()) for p in Path(sys.argv[1], "drafters").glob("*/gpu_training_log.json")]
scored = [(log["eval_served"][-1]["eval_served_tau"], log["variant"]) for log in logs if log["eval_served"]]
print(max(scored)[1] if scored else "")
PY
)
drafter=${best:+$RUN/drafters/$best-bf16}
drafter=${drafter:-models/smollm2-135m-instruct-dflash}
stamp "bench with $drafter"
for name in gsm8k humaneval mt-bench code-edit math500 mbpp alpaca-eval; do  # the most telling first
    prompts=$KIT/prompts/$name.jsonl
    [[ -f "$prompts" ]] || continue
    if (( $(date +%s) + 60 > deadline )); then stamp "no time left for bench $name"; continue; fi
    $PYTHON -m hf_dflash.cli bench --drafter "$drafter" --prompts "$prompts" --num-prompts 0 --device "$DEVICE" \
        --methods "$BENCH_METHODS" --max-new-tokens "$BENCH_TOKENS" --no-progress --out "$RUN/bench/$name" || stamp "bench $name failed"
done

$PYTHON - "$RUN" "$OUT" "$drafter" <<'PY'
import json, sys
from pathlib import Path
run, out, drafter = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
results = {
    "drafter_benched": drafter,
    "training": {p.parent.name: json.loads(p.read_text()) for p in sorted(run.glob("drafters/*/gpu_training_log.json")) if not p.parent.name.endswith("-bf16")},
    "bench": {p.parent.name: json.loads(p.read_text()) for p in sorted(run.glob("bench/*/bench.json"))},
}
(out / "results.json").write_text(json.dumps(results, indent=1))
PY
if [[ -n "$best" ]]; then  # the best drafter, in parts under the 16 MiB-per-file return limit
    tar -C "$RUN/drafters" -cf - "$best-bf16" | split -b 15m -d - "$OUT/best-drafter.tar.part-"
fi
stamp "done: $(ls "$OUT" | tr '\n' ' ')"
