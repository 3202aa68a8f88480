#!/usr/bin/env bash
# The 16 GB card's recipe against TRL's GRPOTrainer, on a GPU: peak GPU memory and step time of QLoRA (NF4 base,
# LoRA r16 on all linear layers, gradient checkpointing) on a Qwen2.5-1.5B-shaped model (random weights: every
# completion runs to the cap, the worst case), 8 generations of 1,024 tokens, first with each trainer's Hugging Face
# sampler, then with a colocated vLLM engine (ours: the adapter synced into vLLM's LoRA slot; TRL: merged weights).
#   bash scripts/bench_16gb.sh                 # writes runs/bench_16gb_{hf,vllm}.json, prints both tables
#   bash scripts/bench_16gb.sh --shape qwen2.5-3b --max_completion_length 2048   # any bench_vs_trl.py flag
# Needs: a CUDA GPU, pip install -r requirements-bench.txt, and vllm for the second half. Not yet run: no GPU has
# been lent to this project (docs/performance.md 3.5).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p runs
common=(--shape qwen2.5-1.5b --use_peft --load_in_4bit --gradient_checkpointing --num_generations 8
        --max_completion_length 1024 --steps 4 --warmup_steps 1 --rounds 1 --trl_bf16 true)
python scripts/bench_vs_trl.py "${common[@]}" --output_json runs/bench_16gb_hf.json "$@"
python scripts/bench_vs_trl.py "${common[@]}" --use_vllm --vllm_gpu_memory_utilization 0.35 \
    --output_json runs/bench_16gb_vllm.json "$@"
