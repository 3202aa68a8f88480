"""What a run logs (docs/watching.md): metrics.jsonl, completions.jsonl and warnings.jsonl, one JSON object a line,
appended by the main process (lib/setup.RUN_LOGS; trimmed to the checkpoint on resume), and the dense console line, one
per logged step: the loop's phase 7 (`log_step`). After each logged line: the health warnings
(lib/apps/health.Watch, the run's `watch`) and the trackers' completion tables (lib/hub.log_completions).
"""

from __future__ import annotations

import json

import torch
from tqdm.auto import tqdm

from lib.hub import log_completions
from lib.setup import Output, Sampler


def append_jsonl(output: Output, name: str, records: list[dict]) -> None:
    """Append `records` to the run's `name` log, on the main process."""
    if output.accelerator.is_main_process and records:
        with open(output.out / name, "a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in records))


def dense_line(step: int, max_steps: int, m: dict, reward_names: list[str]) -> str:
    """One line per logged step: the numbers to watch, in a fixed order."""
    parts = [f"step {step}/{max_steps}", f"reward {m['reward']:.3f}±{m['reward_std']:.2f}"]
    parts += [f"{n} {m[f'rewards/{n}/mean']:.2f}" for n in reward_names]
    parts += [f"zero_std {m['frac_reward_zero_std']:.2f}", f"kl {m['kl']:.4f}",
              f"ent {m['entropy']:.2f}", f"clip {m.get('clip_ratio/region_mean', 0.0):.3f}",
              f"len {m['completions/mean_length']:.0f}", f"lr {m['learning_rate']:.1e}",
              f"gn {m['grad_norm']:.2f}",
              f"{m['step_time']:.1f}s (gen {m.get('time/generation', 0.0):.1f})"]
    return " | ".join(parts)


def batch_metrics(sampler: Sampler, batch) -> dict:
    """The generation batch's rewards, lengths and errors (TRL's key names), as logged with each step on it. `batch`:
    the loop's train_agrpo.Batch (its rewards, total, errors, adv_stats, rollout and group_size)."""
    accelerator, names, rewards = sampler.accelerator, sampler.ctx.reward_names, batch.rewards
    lengths = accelerator.gather(batch.rollout.completion_mask.sum(1).float())
    truncated = accelerator.gather(batch.rollout.is_truncated.float())
    present = [rewards[:, k][~torch.isnan(rewards[:, k])] for k in range(len(names))]
    errors = accelerator.reduce(torch.tensor([batch.errors[n] for n in names],
                                             device=accelerator.device, dtype=torch.float32),
                                reduction="sum")
    return {
        "reward": float(batch.total.mean()),
        "reward_std": float(batch.adv_stats["reward_std"]),
        "frac_reward_zero_std": float(batch.adv_stats["frac_reward_zero_std"]),
        **{f"rewards/{n}/mean": float(torch.nanmean(rewards[:, k])) for k, n in enumerate(names)},
        **{f"rewards/{n}/std": float(p.std()) if p.numel() > 1 else 0.0
           for n, p in zip(names, present)},
        "completions/mean_length": float(lengths.mean()),
        "completions/min_length": float(lengths.min()),
        "completions/max_length": float(lengths.max()),
        "completions/clipped_ratio": float(truncated.mean()),
        "num_generations": batch.group_size,
        **{f"rewards/{n}/errors": float(c) for n, c in zip(names, errors)},
    }


def log_step(output: Output, step: int, metrics: dict, batch, reward_names: list[str], first: int) -> None:
    """Phase 7: metrics.jsonl, the tracker, the dense line, and a few completions to completions.jsonl. `first`: this
    process's first completion in the batch's global order (Geometry.first)."""
    cfg, accelerator = output.cfg, output.accelerator
    append_jsonl(output, "metrics.jsonl", [{"step": step, **metrics}])
    accelerator.log(metrics, step=step)
    if accelerator.is_main_process:
        tqdm.write(dense_line(step, cfg.max_steps, metrics, reward_names))
    output.watch.say(output, step, metrics)  # the health warnings new at this line (lib/apps/health.Watch)
    rows = [{"step": step, "prompt": batch.prompts[i], "completion": batch.texts[i], "answer": batch.answers[i],
             "reward": float(batch.total[first + i]), "advantage": float(batch.advantages[i])}
            for i in range(min(cfg.num_completions_to_print if cfg.log_completions else 0, len(batch.texts)))]
    turns = (batch.rollout.columns or {}).get("turns")  # an agent's episodes: each turn and tool result apart
    for i, row in enumerate(rows):
        if turns is not None and turns[i] is not None:
            row["turns"] = turns[i]
    append_jsonl(output, "completions.jsonl", rows)
    if rows and accelerator.is_main_process:  # a table per tracker: wandb / trackio Tables, TensorBoard text
        log_completions(accelerator, cfg.report_to, rows, step)
