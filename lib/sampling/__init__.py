"""The sampler boundary: the HF sampler (rollout.py) with its copy of the policy (policy_copy.py), its decode steps
(decode.py, cpu_kernels.py), a colocated vLLM engine (vllm_rollout.py), the generation server's client
(generation_server.py), and what the sampling phases work with (context.py)."""
