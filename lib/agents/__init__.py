"""Agents and tools inside a rollout: episodes of tool calls, tools and environments with their worker, a user's
rollout_func in place of the sampler (docs/agents.md)."""
