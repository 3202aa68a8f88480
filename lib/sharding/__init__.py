"""Several processes: FSDP2 and DeepSpeed ZeRO through Accelerate (fsdp_deepspeed.py); the memory estimate and the
guard before the first step (memory.py). docs/distributed.md, docs/performance.md 3."""
