"""Optional parts, each usable alone: the run view and health warnings (`runs`, `health`), the hub and trackers
(`hub`), the generation server's client (`generation_server`), the memory estimator (`memory`), the reward worker
(`reward_worker`), FSDP2 and DeepSpeed (`sharding`). They import the core (`lib/`); the core never imports them. A
newcomer reads `lib/` first."""
