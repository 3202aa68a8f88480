"""Rerun the seeds' comparisons: methods x ablations x seeds, each a `train_agrpo.py` run followed by an
`eval_agrpo.py` comparison with the starting model, then one table and the figures.

    python scripts/ablate.py --methods grpo agrpo --ablations full no_kl no_entropy no_clip g4 --seeds 42 43 \\
        --max_steps 20 --output_dir runs/ablate
    python scripts/ablate.py ... --token_budget 20000 --max_steps 200     # equal generated-token budget
    python scripts/ablate.py ... --devices 0 1 2 3                         # one run per GPU at a time
    python scripts/ablate.py ... -- --config scripts/recipes/agrpo_gsm8k_qwen05b.yaml   # after --: to every run

An ablation is a plain override of the method's resolved configuration (docs/methods.md 9.4): `no_clip` (a clip
range no ratio reaches), `no_kl` (beta 0), `no_entropy` (eta 0), `eps0.1` / `eps0.5`, `beta0.1` / `beta1.0`,
`g4` / `g8` / `g16` (group size, same completions per step). Where a method's controller moves the value the
ablation fixes (A-GRPO's beta_t / epsilon_t, AGPO-DSF's per-group clip), the controller is switched off or its
bounds pinned to the value, so that the ablation means what its name says. A configuration that resolves to the
same settings as another (GRPO's `no_entropy`: its eta is already 0; `no_clip` / `eps*` with one update per
generation batch, where the clip never binds) reuses that run instead of training twice.

Each run trains into `<output_dir>/runs/<method>/<ablation>/seed<seed>/` (no evaluation inside the trainer), then
the evaluator scores its `final/` against the starting model on held-out problems drawn from the run's seed
(`--eval_samples` problems, `--eval_num_samples` samples each at the run's temperature, the accuracy reward):
Win (share of paired samples where the trained model's reward is higher, ties half), Reward, KL to the starting model
and entropy on the model's own samples, Length, accuracy before and after. Generated tokens and steps come from the
run's metrics.jsonl.

Written to <output_dir>: table.md (mean +- sample standard deviation over seeds; `~` marks a difference to the
method's `full` row, or to the first method's same configuration, smaller than the spread), table.csv (the same,
one line per configuration), runs.csv (one line per run), curves/<method>-<ablation>.png (reward, KL, entropy,
length and every controller field the run logged, one line per seed), curves/<ablation>.png (the methods' seed
means side by side), win_rate_bar.png and win_rate_radar.png. Interrupted, it resumes where it stopped: a finished
run or evaluation is kept, a run with a checkpoint continues from it.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import queue
import shlex
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from lib.config import (PRESETS, Config, ConfigError, parse_config, steps_per_rollout, to_dict,  # noqa: E402
                        validate_methods)
from scripts.compare_presets import train_command  # noqa: E402

# name -> what it means (the seeds' twelve configurations: A-GRPO's ablation table)
ABLATIONS = {
    "full": "the method's preset as it is",
    "no_clip": "no clipping (a clip range of 1e6)",
    "no_kl": "no KL term (beta 0, no reference model)",
    "no_entropy": "no entropy bonus (eta 0)",
    "no_kl_no_entropy": "beta 0 and eta 0",
    "eps0.1": "clip range 0.1", "eps0.5": "clip range 0.5",
    "beta0.1": "KL coefficient 0.1", "beta1.0": "KL coefficient 1.0",
    "g4": "4 completions per prompt", "g8": "8 completions per prompt", "g16": "16 completions per prompt",
}
NO_CLIP = 1e6
LAST = 5  # training steps averaged for the end-of-run training columns
# Controller fields the trainer logs (docs/methods.md 9.3); a run's curves show the ones it logged.
CONTROLLER_FIELDS = ("beta", "epsilon", "kl_ema", "next_beta", "next_epsilon", "num_generations", "temperature",
                     "epsilon/group_min", "epsilon/group_max", "entropy_ref", "uncertainty_baseline", "step_kl_ema",
                     "vote_entropy", "resample_rounds", "resampled_prompts", "num_tokens/probe",
                     "num_tokens/resampled", "rewards/length/mean")
# table columns: key -> (heading, format); "higher is better" is not assumed for any of them
METRICS = {"win_rate": ("Win", "{:.1%}"), "accuracy": ("Accuracy", "{:.1%}"), "reward": ("Reward", "{:.3f}"),
           "kl": ("KL", "{:.4f}"), "entropy": ("Entropy", "{:.3f}"), "length": ("Length", "{:.1f}"),
           "num_tokens": ("Generated tokens", "{:,.0f}"), "steps": ("Steps", "{:.0f}"),
           "zero_spread": ("Zero-spread groups", "{:.1%}"), "no_signal_steps": ("No-signal steps", "{:.1%}")}


# settings a dry run shows per run
DRY_RUN_KEYS = ("model_name_or_path", "max_steps", "max_num_tokens", "learning_rate", "lr_scheduler_type",
                "warmup_ratio", "beta", "adaptive_kl", "kl_estimator", "epsilon", "eta", "num_generations",
                "per_device_train_batch_size", "gradient_accumulation_steps", "max_prompt_length",
                "max_completion_length", "temperature", "use_vllm", "seed")


class AblateError(ValueError):
    """A harness argument that cannot work; the message names it and the fix."""


# ---------------------------------------------------------------------------------------------------------------
# Configurations (pure)


def ablation_overrides(name: str, cfg: Config) -> dict:
    """The keys that turn the method's resolved configuration `cfg` into ablation `name` (docs/methods.md 9.4)."""
    if name == "full":
        return {}
    if name == "no_kl":
        return {"beta": 0.0, **({"adaptive_kl": False} if cfg.adaptive_kl else {})}
    if name == "no_entropy":
        return {"eta": 0.0}
    if name == "no_kl_no_entropy":
        return {**ablation_overrides("no_kl", cfg), "eta": 0.0}
    if name == "no_clip" or name.startswith("eps"):
        eps = NO_CLIP if name == "no_clip" else float(name[3:])
        keys = {"epsilon": eps, "epsilon_high": eps}
        if cfg.adaptive_kl:  # A-GRPO moves epsilon_t inside [epsilon_min, epsilon_max]: pin it
            keys.update(epsilon_min=eps, epsilon_max=eps)
        if cfg.dsf:  # AGPO-DSF sets each group's clip inside [dsf_eps_min, dsf_eps_max]: pin it
            keys.update(dsf_eps_min=eps, dsf_eps_max=eps)
        return keys
    if name.startswith("beta"):
        beta = float(name[4:])
        # A-GRPO's beta_t would move off the value: a fixed coefficient means the controller is off
        return {"beta": beta, **({"adaptive_kl": False} if cfg.adaptive_kl else {})}
    if name.startswith("g") and name[1:].isdigit():
        group = int(name[1:])
        batch = cfg.per_device_train_batch_size
        keys = {"num_generations": group, "adaptive_group_size": False}
        if batch % group:  # keep the completions per step, rounded up to whole groups
            keys["per_device_train_batch_size"] = group * math.ceil(batch / group)
        return keys
    raise AblateError(f"--ablations: '{name}' is not one of {', '.join(ABLATIONS)}")


CLIP_KEYS = ("epsilon", "epsilon_high", "epsilon_min", "epsilon_max", "dsf_eps_min", "dsf_eps_max", "dual_clip")


def run_identity(cfg: Config) -> dict:
    """The settings that decide what a run computes. With one update per generation batch and one step per rollout
    (and no AGPO-DSF, whose old log-probs come from a pass of their own) the ratio pi / pi_old is exactly 1 at every
    token (pi_old is the same forward, detached), so no clip range binds and the clip settings change nothing:
    `no_clip` and `eps*` then share the `full` run."""
    settings = {k: v for k, v in to_dict(cfg).items() if k != "output_dir"}
    if steps_per_rollout(cfg) == 1 and not cfg.dsf:
        for key in CLIP_KEYS:
            settings.pop(key)
    return settings


def as_flags(keys: dict) -> list[str]:
    flags = []
    for key, value in keys.items():
        flags += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    return flags


@dataclass
class Job:
    method: str
    ablation: str
    seed: int
    flags: list[str]  # the trainer's flags after `--algo <method> [--max_steps <n>]`
    run_dir: Path
    cfg: Config
    same_as: str | None = None  # "<method>/<ablation>" whose run this configuration reuses


def plan(methods: list[str], ablations: list[str], seeds: list[int], extra: list[str], root: Path,
         max_steps: int | None, token_budget: int | None) -> list[Job]:
    """Every (method, ablation, seed) with its resolved, validated configuration, before anything runs. Bad input
    (an unknown method or ablation, a flag the trainer refuses) raises here, naming the configuration."""
    common = ["--num_eval_samples", "0"] + (["--max_num_tokens", str(token_budget)] if token_budget else [])
    jobs: list[Job] = []
    first_with: dict[str, Job] = {}  # resolved settings -> the first job that has them
    for method in methods:
        if method not in PRESETS:
            raise AblateError(f"--methods: '{method}' is not a preset; choose from {', '.join(PRESETS)}")
        for ablation in ablations:
            for seed in seeds:
                flags = [*common, *extra, "--seed", str(seed)]
                head = ["--algo", method, *(["--max_steps", str(max_steps)] if max_steps else [])]
                try:
                    flags += as_flags(ablation_overrides(ablation, parse_config([*head, *flags])))
                    cfg = parse_config([*head, *flags])
                    validate_methods(cfg, cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps)
                except ConfigError as error:
                    raise AblateError(f"{method} / {ablation} / seed {seed}: {error}") from None
                data = cfg.dataset_name
                if data and not cfg.eval_dataset_name and Path(data).is_file():
                    raise AblateError(f"dataset_name '{data}' is one file, with no held-out "
                                      f"split to evaluate on: pass --eval_dataset_name <file> after --")
                identity = json.dumps(run_identity(cfg), sort_keys=True, default=str)
                job = Job(method, ablation, seed, flags, root / "runs" / method / ablation / f"seed{seed}", cfg)
                if identity in first_with:  # the same settings as a configuration already planned: reuse its run
                    first = first_with[identity]
                    job.run_dir, job.same_as = first.run_dir, f"{first.method}/{first.ablation}"
                else:
                    first_with[identity] = job
                jobs.append(job)
    return jobs


# ---------------------------------------------------------------------------------------------------------------
# Running (subprocesses; resumable)


def eval_command(job: Job, eval_samples: int, eval_num_samples: int, temperature: float | None) -> list[str]:
    """The evaluator against the run's starting model, at the run's sampling settings and backend, on held-out
    problems drawn from the run's seed (the built-in task) or the run's evaluation data."""
    cfg = job.cfg
    command = [sys.executable, str(REPO / "eval_agrpo.py"), "--model_name_or_path", str(job.run_dir / "final"),
               "--reference_model", cfg.model_name_or_path, "--num_samples", str(eval_num_samples),
               "--temperature", str(cfg.temperature if temperature is None else temperature), "--top_p", str(cfg.top_p),
               "--top_k", str(cfg.top_k),
               "--max_samples", str(eval_samples), "--seed", str(job.seed),
               "--max_prompt_length", str(cfg.max_prompt_length),
               "--max_completion_length", str(cfg.max_completion_length), "--instruction", cfg.instruction,
               "--output_dir", str(job.run_dir / "eval"), "--output_json", str(job.run_dir / "eval.json"),
               "--overwrite_output_dir", "true"]
    if cfg.system_prompt:
        command += ["--system_prompt", cfg.system_prompt]
    if cfg.use_vllm:  # the run's backend
        command += ["--use_vllm", "true", "--vllm_gpu_memory_utilization", str(cfg.vllm_gpu_memory_utilization)]
    data = cfg.eval_dataset_name or cfg.dataset_name
    if data:
        command += ["--dataset_name", data, "--split", cfg.dataset_test_split]
    return command


def run_logged(command: list[str], log: Path, env: dict | None) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        f.write(f"\n$ {' '.join(command)}\n")
        f.flush()
        code = subprocess.run(command, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    if code != 0:
        raise RuntimeError(f"exit code {code}; the last lines of {log} say why. Fix it and run the same command "
                           f"again: finished runs are kept")


def execute(job: Job, evaluation: dict, device: str | None) -> str:
    """Train (or resume) and evaluate one run unless already done; returns what happened."""
    env = None if device is None else {**os.environ, "CUDA_VISIBLE_DEVICES": device}
    log = job.run_dir.parent / f"seed{job.seed}.log"
    did = []
    command = train_command(job.method, job.run_dir, job.cfg.max_steps, job.flags)
    if command is not None:
        start = time.perf_counter()
        run_logged(command, log, env)
        did.append(f"trained in {(time.perf_counter() - start) / 60:.1f} min")
    if not (job.run_dir / "eval.json").exists():
        start = time.perf_counter()
        run_logged(eval_command(job, **evaluation), log, env)
        did.append(f"evaluated in {(time.perf_counter() - start) / 60:.1f} min")
    return ", ".join(did) or "already done"


def run_all(jobs: list[Job], evaluation: dict, devices: list[str] | None) -> None:
    """Sequentially, or one run per device at a time (`--devices`). `evaluation`: eval_command's keywords."""
    todo = [j for j in jobs if j.same_as is None]
    lock = threading.Lock()
    failures: list[str] = []
    work: queue.Queue = queue.Queue()
    for i, job in enumerate(todo):
        work.put((i, job))

    def worker(device: str | None) -> None:
        while not failures:
            try:
                i, job = work.get_nowait()
            except queue.Empty:
                return
            name = f"{job.method} / {job.ablation} / seed {job.seed}"
            try:
                what = execute(job, evaluation, device)
            except RuntimeError as error:
                with lock:
                    failures.append(f"{name}: {error}")
                return
            with lock:
                print(f"[{i + 1}/{len(todo)}] {name}: {what}", flush=True)

    threads = [threading.Thread(target=worker, args=(d,)) for d in (devices or [None])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise RuntimeError("; ".join(failures))


# ---------------------------------------------------------------------------------------------------------------
# Results (pure: files in, rows out)


def read_metrics(run_dir: Path) -> list[dict]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [m for m in lines if "reward" in m]


def starvation(train: list[dict]) -> dict:
    """How often a run had nothing to learn from: the mean share of groups whose rewards were all equal
    (`frac_reward_zero_std`, after any resampling or filtering the method does), and the share of steps in which
    every group was so (GRPO's advantages all zero; AGPO's fixed advantages for such groups are counted as no
    spread here too: docs/results.md 8)."""
    shares = [m["frac_reward_zero_std"] for m in train if "frac_reward_zero_std" in m]
    if not shares:
        return {"zero_spread": math.nan, "no_signal_steps": math.nan}
    return {"zero_spread": statistics.fmean(shares),
            "no_signal_steps": sum(share >= 1.0 - 1e-9 for share in shares) / len(shares)}


def run_row(job: Job) -> dict:
    """One run's numbers: the evaluator's (win rate, reward, KL, entropy, length and accuracy of the trained model;
    the starting model's accuracy) and the run's own (generated tokens, steps, training reward over the last steps,
    how often its groups had no reward spread)."""
    results = json.loads((job.run_dir / "eval.json").read_text())["results"]
    policy, reference = results[0], results[-1]  # the evaluator scores the models in order, the reference last
    train = read_metrics(job.run_dir)
    last = train[-LAST:]
    return {"method": job.method, "ablation": job.ablation, "seed": job.seed, "win_rate": policy["win_rate"],
            "accuracy": policy["accuracy"], "accuracy_start": reference["accuracy"], "reward": policy["reward"],
            "kl": policy["kl"], "entropy": policy["entropy"], "length": policy["mean_length"],
            "num_tokens": train[-1]["num_tokens"], "steps": train[-1]["step"],
            "train_reward": statistics.fmean(m["reward"] for m in last), **starvation(train),
            "same_as": job.same_as or ""}


def mean_spread(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation over seeds (spread 0 with one seed)."""
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def within_spread(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """True when two configurations' means differ by less than their spread: |mean_a - mean_b| < sqrt(sd_a^2 + sd_b^2),
    the seed-to-seed standard deviation of the difference of one run of each. With one seed per configuration there
    is no spread, and nothing is marked."""
    return abs(a[0] - b[0]) < math.hypot(a[1], b[1])


def aggregate(rows: list[dict]) -> dict[tuple[str, str], dict]:
    """(method, ablation) -> {metric: (mean, sd)} over seeds, plus the seeds and whether the run was shared."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["method"], r["ablation"]), []).append(r)
    out = {}
    for key, rs in groups.items():
        stats = {m: mean_spread([r[m] for r in rs]) for m in (*METRICS, "accuracy_start", "train_reward")}
        out[key] = {**stats, "seeds": [r["seed"] for r in rs], "same_as": rs[0]["same_as"]}
    return out


def cell(metric: str, value: tuple[float, float], seeds: int, flag: bool) -> str:
    fmt = METRICS[metric][1] if metric in METRICS else "{:.1%}"
    text = fmt.format(value[0]) + (f" ± {fmt.format(value[1])}" if seeds > 1 else "")
    return text + (" ~" if flag else "")


def table_markdown(agg: dict[tuple[str, str], dict], methods: list[str], ablations: list[str]) -> str:
    """The seeds' table: one row per (ablation, method), mean ± sd over seeds; `~` where the difference to the same
    method's `full` row is smaller than the spread. Then the methods against the first one, per configuration."""
    head = ["Configuration", "Method", "Accuracy start", *(METRICS[m][0] for m in METRICS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for ablation in ablations:
        for method in methods:
            a = agg[(method, ablation)]
            full = agg.get((method, "full"))
            n = len(a["seeds"])
            name = ablation + (f" (= {a['same_as']})" if a["same_as"] else "")
            cells = [name, method, cell("accuracy_start", a["accuracy_start"], n, False)]
            for m in METRICS:
                flag = ablation != "full" and full is not None and n > 1 and not a["same_as"] \
                    and within_spread(a[m], full[m])
                cells.append(cell(m, a[m], n, flag))
            lines.append("| " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    if len(methods) > 1:
        base = methods[0]
        diff_metrics = ("win_rate", "accuracy", "reward", "kl", "entropy", "length", "num_tokens", "zero_spread")
        head = ["Configuration", "Method", *(f"Δ {METRICS[m][0]}" for m in diff_metrics)]
        lines = ["", f"Differences to {base} (mean of the method - mean of {base}; `~`: smaller than the spread):",
                 "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for ablation in ablations:
            for method in methods[1:]:
                a, b = agg[(method, ablation)], agg[(base, ablation)]
                n = min(len(a["seeds"]), len(b["seeds"]))
                cells = [ablation, method]
                for m in diff_metrics:
                    fmt = METRICS[m][1].replace("{:", "{:+")
                    flag = n > 1 and within_spread(a[m], b[m])
                    cells.append(fmt.format(a[m][0] - b[m][0]) + (" ~" if flag else ""))
                lines.append("| " + " | ".join(cells) + " |")
        text += "\n".join(lines) + "\n"
    return text


def write_csvs(rows: list[dict], agg: dict[tuple[str, str], dict], out: Path) -> None:
    with open(out / "runs.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    names = (*METRICS, "accuracy_start", "train_reward")
    with open(out / "table.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["method", "ablation", "seeds", "same_as",
                         *(f"{m}_{s}" for m in names for s in ("mean", "sd"))])
        for (method, ablation), a in agg.items():
            writer.writerow([method, ablation, " ".join(map(str, a["seeds"])), a["same_as"],
                             *(v for m in names for v in a[m])])


# ---------------------------------------------------------------------------------------------------------------
# Figures


def plot_curves(jobs: list[Job], methods: list[str], ablations: list[str], out: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    main = [("reward", "reward (training samples)"), ("kl", "KL to reference"), ("entropy", "entropy"),
            ("completions/mean_length", "completion length")]
    folder = out / "curves"
    folder.mkdir(exist_ok=True)
    written = []
    runs = {(j.method, j.ablation, j.seed): read_metrics(j.run_dir) for j in jobs}
    for method in methods:  # one figure per configuration: the main curves and every controller field logged
        for ablation in ablations:
            seeds = [j.seed for j in jobs if (j.method, j.ablation) == (method, ablation)]
            logged = [k for k in CONTROLLER_FIELDS if any(k in m for s in seeds for m in runs[(method, ablation, s)])]
            panels = main + [(k, k) for k in logged if k not in dict(main)]
            cols = 4
            rows = math.ceil(len(panels) / cols)
            fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
            for ax, (key, title) in zip(axes.flat, panels):
                for s in seeds:
                    points = [(m["step"], m[key]) for m in runs[(method, ablation, s)] if key in m]
                    if points:
                        ax.plot(*zip(*points), label=f"seed {s}", linewidth=1.2, marker="o" if len(points) < 4 else "")
                label_panel(ax, title)
            for ax in list(axes.flat)[len(panels):]:
                ax.axis("off")
            written.append(save_figure(fig, axes, f"{method} / {ablation}", folder / f"{method}-{ablation}.png"))
    for ablation in ablations:  # the methods side by side, seed means
        fig, axes = plt.subplots(1, len(main), figsize=(4 * len(main), 3), squeeze=False)
        for ax, (key, title) in zip(axes.flat, main):
            for method in methods:
                curves = [[m.get(key) for m in runs[(method, ablation, j.seed)]]
                          for j in jobs if (j.method, j.ablation) == (method, ablation)]
                steps = min(len(c) for c in curves)
                means = [statistics.fmean(c[i] for c in curves) if all(c[i] is not None for c in curves) else None
                         for i in range(steps)]
                ax.plot(range(1, steps + 1), [float("nan") if v is None else v for v in means], label=method,
                        marker="o" if steps < 4 else "")
            label_panel(ax, title)
        written.append(save_figure(fig, axes, f"{ablation}: mean over seeds", folder / f"{ablation}.png"))
    return written


def label_panel(ax, title: str) -> None:
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=8)


def save_figure(fig, axes, title: str, path: Path) -> Path:
    import matplotlib.pyplot as plt

    axes.flat[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_win_rates(agg: dict[tuple[str, str], dict], methods: list[str], ablations: list[str],
                   out: Path) -> list[Path]:
    """Bar chart (configurations x methods, error bars: sd over seeds) and radar plot (one axis per configuration)
    of the win rate against the starting model; 50% is a tie."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width = 0.8 / len(methods)
    fig, ax = plt.subplots(figsize=(max(5, 1.4 * len(ablations) * max(1, len(methods) / 2)), 3.6))
    for i, method in enumerate(methods):
        xs = [k + (i - (len(methods) - 1) / 2) * width for k in range(len(ablations))]
        ax.bar(xs, [agg[(method, a)]["win_rate"][0] for a in ablations], width,
               yerr=[agg[(method, a)]["win_rate"][1] for a in ablations], capsize=3, label=method)
    ax.axhline(0.5, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(ablations)), ablations)
    ax.set_ylabel("win rate vs starting model")
    ax.set_ylim(0, 1)
    ax.legend()
    fig.tight_layout()
    bar = out / "win_rate_bar.png"
    fig.savefig(bar, dpi=100)
    plt.close(fig)

    angles = [2 * math.pi * k / len(ablations) for k in range(len(ablations))]
    fig = plt.figure(figsize=(4.8, 4.8))
    ax = fig.add_subplot(projection="polar")
    for method in methods:
        values = [agg[(method, a)]["win_rate"][0] for a in ablations]
        ax.plot(angles + angles[:1], values + values[:1], marker="o", label=method)
        ax.fill(angles + angles[:1], values + values[:1], alpha=0.12)
    ax.plot([*angles, angles[0]], [0.5] * (len(angles) + 1), color="grey", linewidth=0.8, linestyle="--")
    ax.set_xticks(angles, ablations)
    ax.set_ylim(0, 1)
    ax.legend(loc="upper right", bbox_to_anchor=(1.25, 1.1), fontsize=8)
    ax.set_title("win rate vs starting model")
    fig.tight_layout()
    radar = out / "win_rate_radar.png"
    fig.savefig(radar, dpi=100)
    plt.close(fig)
    return [bar, radar]


# ---------------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    argv = sys.argv[1:] if argv is None else list(argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Arguments after -- go to every train_agrpo.py run.")
    p.add_argument("--methods", nargs="+", default=["grpo", "agrpo"], help=f"Presets: {', '.join(PRESETS)}.")
    p.add_argument("--ablations", nargs="+", default=["full"], help=f"Any of: {', '.join(ABLATIONS)}.")
    p.add_argument("--seeds", nargs="+", type=int, default=[42, 43])
    p.add_argument("--max_steps", type=int, default=None, help="Optimizer steps per run, the ceiling with "
                   "--token_budget (default: the recipe's, or the trainer's 40).")
    p.add_argument("--token_budget", type=int, default=None, help="Stop every run at this many generated tokens "
                   "(the trainer's max_num_tokens): methods compared at an equal budget.")
    p.add_argument("--eval_samples", type=int, default=200, help="Held-out problems per evaluation.")
    p.add_argument("--eval_num_samples", type=int, default=2, help="Samples per problem for Win / Reward / KL.")
    p.add_argument("--eval_temperature", type=float, default=None, help="Sampling temperature of the evaluation "
                   "(default: each run's training temperature; 0 = greedy, then Win compares greedy answers).")
    p.add_argument("--devices", nargs="+", default=None, help="GPU ids: one run per device at a time (default: "
                   "one run after the other).")
    p.add_argument("--output_dir", default="runs/ablate")
    p.add_argument("--dry_run", action="store_true", help="Print each run's resolved settings and commands, run "
                   "nothing.")
    args = p.parse_args(own)
    for name in ("max_steps", "eval_samples", "eval_num_samples"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise AblateError(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.eval_temperature is not None and args.eval_temperature < 0:
        raise AblateError(f"--eval_temperature must be at least 0 (0 = greedy), got {args.eval_temperature}")
    if args.eval_temperature == 0 and args.eval_num_samples > 1:
        raise AblateError("--eval_temperature 0 (greedy) gives one answer per problem: pass --eval_num_samples 1")
    if args.token_budget is not None and args.token_budget < 1:
        raise AblateError(f"--token_budget must be at least 1 (generated tokens), got {args.token_budget}")
    for flag in ("--output_dir", "--seed", "--algo", "--resume_from_checkpoint", "--overwrite_output_dir"):
        if flag in extra:
            raise AblateError(f"{flag} after --: the harness sets it for each run; use its own options instead")
    unknown = [a for a in args.ablations if a not in ABLATIONS]
    if unknown:
        raise AblateError(f"--ablations: {', '.join(unknown)} not known; choose from {', '.join(ABLATIONS)}")
    return args, extra


def main(argv: list[str] | None = None) -> dict:
    args, extra = parse_args(argv)
    out = Path(args.output_dir)
    methods, ablations = list(dict.fromkeys(args.methods)), list(dict.fromkeys(args.ablations))
    jobs = plan(methods, ablations, args.seeds, extra, out, args.max_steps, args.token_budget)
    if args.dry_run:
        for job in jobs:
            print(f"{job.method} / {job.ablation} / seed {job.seed}: " + (f"= {job.same_as}" if job.same_as else
                  json.dumps({k: v for k, v in to_dict(job.cfg).items() if k in DRY_RUN_KEYS})))
            command = None if job.same_as else train_command(job.method, job.run_dir, job.cfg.max_steps, job.flags)
            if command:
                shown = ["python", str(Path(command[1]).relative_to(REPO)), *command[2:]]
                print("  " + " ".join(shlex.quote(part) for part in shown))
        return {"jobs": jobs}
    out.mkdir(parents=True, exist_ok=True)
    (out / "ablate.yaml").write_text(yaml.safe_dump({"command": "python scripts/ablate.py " + " ".join(
        sys.argv[1:] if argv is None else argv), **{k: v for k, v in vars(args).items()}, "trainer_args": extra},
        sort_keys=False))
    distinct = sum(j.same_as is None for j in jobs)
    print(f"{len(jobs)} configurations x seeds, {distinct} distinct runs, into {out}", flush=True)
    run_all(jobs, {"eval_samples": args.eval_samples, "eval_num_samples": args.eval_num_samples,
                   "temperature": args.eval_temperature}, args.devices)

    rows = [run_row(j) for j in jobs]
    agg = aggregate(rows)
    text = table_markdown(agg, methods, ablations)
    if args.token_budget is not None:
        short = [f"{r['method']}/{r['ablation']}/seed {r['seed']}" for r in rows if r["num_tokens"] < args.token_budget]
        if short:
            text += (f"\nStopped at max_steps before the budget of {args.token_budget:,} tokens "
                     f"(raise --max_steps for an equal budget): {', '.join(short)}\n")
    (out / "table.md").write_text(text)
    write_csvs(rows, agg, out)
    figures = plot_curves(jobs, methods, ablations, out) + plot_win_rates(agg, methods, ablations, out)
    print(text)
    print(f"wrote table.md, table.csv, runs.csv and {len(figures)} figures in {out}")
    return {"rows": rows, "aggregate": agg, "jobs": jobs}


if __name__ == "__main__":
    try:
        main()
    except (AblateError, RuntimeError) as error:
        sys.exit(f"error: {error}")
