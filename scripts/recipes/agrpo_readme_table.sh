#!/usr/bin/env bash
# The A-GRPO README's GSM8K table, rerun: GRPO and A-GRPO trained at the README's training settings
# (agrpo_gsm8k_qwen05b.yaml: Qwen2.5-0.5B-Instruct, full fine-tuning, lr 5e-7 cosine, warmup 0.03, beta 0.001,
# 8 generations, 256 / 1024 prompt / completion tokens, 450 steps, vLLM rollouts at 0.5 of the GPU), each then
# scored greedily on all 1,319 GSM8K test problems next to the starting model (accuracy, and Win / Reward / KL /
# entropy / length against it), seeds' mean and spread in <OUT>/table.md, curves and win-rate plots beside it.
#
# The README's "batch_size 16" is 16 completions a step (2 prompts x 8); on one GPU that is 4 completions a
# micro-batch x 4 accumulation steps here (the loss is normalised over the global batch, so the split does not
# change the gradient). Both methods run at beta 0.001, the table's value; A-GRPO's controller moves it from there.
#
# Expected run time: an estimate, not a measurement (no GPU was available to us): per step, vLLM samples 16
# completions of a 0.5B model (latency-bound, about 4-6 ms a token for up to 1,024 tokens: 3-5 s), the policy
# forward and backward on 16 x ~450 tokens with checkpointing plus the reference forward take under 1 s, the weight
# sync into vLLM about 0.3 s: 4-7 s a step, so 30-55 minutes per 450-step run on one H100, and about 5 minutes for
# each evaluation. One seed of both methods: about 1.2-2 hours on one GPU, half that with DEVICES="0 1" (one run per
# GPU). Three seeds (SEEDS="42 43 44") give the spread the table needs to call a difference real.
#
#   bash scripts/recipes/agrpo_readme_table.sh     # DATA: folder with GSM8K's train/test.jsonl (default: the
#                                                  # gsm8k/ folder of $AGRPO_DATA_DIR, or of ../shared/data)
#   SEEDS="42 43 44" DEVICES="0 1 2 3" bash scripts/recipes/agrpo_readme_table.sh
#   bash scripts/recipes/agrpo_readme_table.sh --dry_run       # each run's resolved settings; runs nothing
# Interrupted, run it again: finished runs and evaluations are kept, a run with a checkpoint resumes (save_steps 25).
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repository root: DATA and OUT are relative to it
DATA=${DATA:-${AGRPO_DATA_DIR:-../shared/data}/gsm8k}
OUT=${OUT:-runs/agrpo_readme_table}
SEEDS=${SEEDS:-42}
DEVICES=${DEVICES:-0}
# shellcheck disable=SC2086  # SEEDS and DEVICES are lists
python scripts/ablate.py --methods grpo agrpo --ablations full --seeds $SEEDS --devices $DEVICES \
    --eval_samples 1319 --eval_num_samples 1 --eval_temperature 0 --output_dir "$OUT" "$@" \
    -- --config scripts/recipes/agrpo_gsm8k_qwen05b.yaml \
       --dataset_name "$DATA/train.jsonl" --eval_dataset_name "$DATA/test.jsonl" \
       --per_device_train_batch_size 4 --gradient_accumulation_steps 4
