"""Warnings about a run's health, from its metric lines (docs/watching.md 3).

Pure functions over a list of metric dicts exactly as `metrics.jsonl` holds them: training lines (they have
`reward`) and evaluation lines (`eval/accuracy`), in the order they were written, plus the run's configuration
(config.yaml, or the trainer's Config as a dict) for the values the checks compare against (kl_target) and name in
their advice. The checks read no files and keep no state; `Watch` keeps a trainer's history and says its warnings
(console, warnings.jsonl), and `python -m lib.apps.health RUN_FOLDER...` prints the warnings of runs on disk.

    check(lines, config)      the warnings that hold at the end of the lines (what the run is doing now)
    episodes(lines, config)   every stretch of steps over which a warning held, with its worst numbers
    unseen(warnings, seen)    the warnings whose kind is not in `seen`
    Watch(config).add(line)   a trainer's history: the warnings new at this line (each kind once); `report` words
                              them as console lines and warnings.jsonl records, `say` prints and appends them

The checks, each over the last WINDOW logged training steps:
    reward_hacking     training reward rising while held-out accuracy falls by more than its noise
    entropy_collapse   policy entropy below ENTROPY_COLLAPSE_RATIO of what it was over the first steps
    truncation         more than half of the completions cut at max_completion_length
    zero_spread        more than half of the groups with one reward for all their completions (no gradient)
    kl_above_target    (A-GRPO's controller) the KL moving average above KL_TARGET_FACTOR x kl_target
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from lib.apps.runs import METRICS, read_config, read_jsonl

WINDOW = 5  # logged training steps a check averages over (one step is too noisy with 2 prompts x 8 completions)
ENTROPY_COLLAPSE_RATIO = 0.15  # recent entropy / entropy over the first WINDOW steps
MOST = 0.5  # "most": a share above this
KL_TARGET_FACTOR = 2.0  # "far above" the controller's target
ACCURACY_DROP_MIN = 0.02  # a held-out accuracy drop smaller than 2 points is never reported
NOISE_Z = 2.0  # ... nor one within 2 standard errors of the difference of two accuracies

KINDS = ("reward_hacking", "entropy_collapse", "truncation", "zero_spread", "kl_above_target")


@dataclass(frozen=True)
class HealthWarning:
    """One warning: what (kind, title), where (first_step..step), the numbers behind it (evidence, and `numbers` for
    a program), and what to try in this package's options (advice)."""

    kind: str
    title: str
    first_step: int
    step: int
    evidence: str
    advice: str
    numbers: dict = field(default_factory=dict, compare=False)

    @property
    def steps(self) -> str:
        return f"step {self.step}" if self.first_step == self.step else f"steps {self.first_step}-{self.step}"


def console_line(warning: HealthWarning) -> str:
    """One line for a console: `warning (steps a-b): title: evidence. Try: advice`."""
    return f"warning ({warning.steps}): {warning.title}: {warning.evidence}. Try: {warning.advice}"


def unseen(warnings: list[HealthWarning], seen: set[str] | frozenset[str]) -> list[HealthWarning]:
    """The warnings whose kind is not in `seen` (the caller adds the kinds it prints to its set)."""
    return [w for w in warnings if w.kind not in seen]


class Watch:
    """A trainer's own metric history, checked after every line it logs: `add(line)` returns the warnings that hold
    now and were not reported before (each kind once per run). On resume, start it with the
    lines the run kept (metrics.jsonl up to the checkpoint), so a warning printed before the stop is not repeated
    and the windows span the restart."""

    def __init__(self, config: dict, lines: list[dict] | None = None):
        self.config = config
        self.history = list(lines or [])
        self.seen = {w.kind for w in episodes(self.history, config)} if self.history else set()

    def add(self, line: dict) -> list[HealthWarning]:
        self.history.append(line)
        fresh = unseen(check(self.history, self.config), self.seen)
        self.seen.update(w.kind for w in fresh)
        return fresh

    def report(self, step: int, metrics: dict) -> tuple[list[str], list[dict]]:
        """The warnings new at this logged line (`add`), as `say` says them: one console line each, and one
        warnings.jsonl record each. A warning an evaluation raised carries an eval/ key, so that a
        resume at this step, which redoes the evaluation, sets it aside with the evaluation's line
        (lib/checkpoint.trim_jsonl)."""
        fresh = self.add({"step": step, **metrics})
        after_eval = {"eval/raised_by_evaluation": True} if any(k.startswith("eval/") for k in metrics) else {}
        records = [{"step": step, "kind": w.kind, "title": w.title, "first_step": w.first_step,
                    "evidence": w.evidence, "advice": w.advice, **after_eval} for w in fresh]
        return [console_line(w) for w in fresh], records

    def say(self, output, step: int, metrics: dict) -> None:
        """Say each kind of warning (zero-spread groups, truncation, entropy collapse, reward hacking, a KL above its
        target) once, at the first logged line where it holds (`report`), on the main process: on the console and in
        the run's warnings.jsonl. The trainer calls it as `Output.watch` after each logged line (lib/logs.log_step)
        and evaluation; `output` is the run's lib/setup.Output (accelerator, out)."""
        if output.accelerator.is_main_process:
            lines, records = self.report(step, metrics)
            for line in lines:
                tqdm.write(line)
            if records:
                with open(output.out / "warnings.jsonl", "a") as f:
                    f.write("".join(json.dumps(r) + "\n" for r in records))


def split_lines(lines: list[dict]) -> tuple[list[dict], list[dict]]:
    """(training lines, evaluation lines) of a metrics history; lines without a step or a finite value are ignored."""
    lines = [m for m in lines if isinstance(m, dict) and isinstance(m.get("step"), int)]
    train = [m for m in lines if _number(m.get("reward")) is not None]
    evals = [m for m in lines if _number(m.get("eval/accuracy")) is not None]
    return train, evals


def check(lines: list[dict], config: dict | None = None) -> list[HealthWarning]:
    """The warnings that hold over the last WINDOW training lines of `lines` (and its evaluations so far)."""
    train, evals = split_lines(lines)
    return _check(train, evals, config or {})


def episodes(lines: list[dict], config: dict | None = None) -> list[HealthWarning]:
    """Every stretch of steps over which a warning held, as one warning from its first to its last step with the
    numbers of the step where it was worst, in order of their first step. A stretch starts at the first step of the
    window over which the warning first held; two stretches of one kind whose windows touch are one (a share that
    hovers at its threshold would otherwise come and go at every step)."""
    train, evals = split_lines(lines)
    config = config or {}
    open_: dict[str, tuple[int, int, HealthWarning]] = {}  # kind -> (first step, last step, worst warning)
    done: list[HealthWarning] = []
    for i, line in enumerate(train):
        now = {w.kind: w for w in _check(train[: i + 1], [e for e in evals if e["step"] <= line["step"]], config)}
        for kind in [k for k in open_ if k not in now]:
            done.append(_span(*open_.pop(kind)))
        for kind, warning in now.items():
            first, _, worst = open_.get(kind, (warning.first_step, warning.step, warning))
            worse = warning.numbers["severity"] >= worst.numbers["severity"]
            open_[kind] = (first, warning.step, warning if worse else worst)
    done += [_span(*value) for value in open_.values()]
    merged: list[HealthWarning] = []  # a warning that lapses for a few steps and returns is one episode
    for warning in sorted(done, key=lambda w: (KINDS.index(w.kind), w.first_step)):
        last = merged[-1] if merged and merged[-1].kind == warning.kind else None
        if last is not None and warning.first_step <= last.step + 1:  # their windows touch
            worst = warning if warning.numbers["severity"] >= last.numbers["severity"] else last
            merged[-1] = _span(last.first_step, max(last.step, warning.step), worst)
        else:
            merged.append(warning)
    return sorted(merged, key=lambda w: (w.first_step, KINDS.index(w.kind)))


# ---------------------------------------------------------------------------------------------------------------------


def _check(train: list[dict], evals: list[dict], config: dict) -> list[HealthWarning]:
    found = [_reward_hacking(train, evals, config), _entropy_collapse(train, config), _truncation(train, config),
             _zero_spread(train, config), _kl_above_target(train, config)]
    return [w for w in found if w is not None]


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(
        value) else None


def _mean(lines: list[dict], key: str) -> float | None:
    values = [v for v in (_number(m.get(key)) for m in lines) if v is not None]
    return sum(values) / len(values) if values else None


def _steps(lines: list[dict]) -> str:
    first, last = lines[0]["step"], lines[-1]["step"]
    return f"step {first}" if first == last else f"steps {first}-{last}"


def _span(first: int, last: int, worst: HealthWarning) -> HealthWarning:
    return HealthWarning(worst.kind, worst.title, first, last, worst.evidence, worst.advice, worst.numbers)


PRESET_REMEDIES = {  # what a preset changes that helps, per check (docs/methods.md 9)
    "entropy_collapse": (("dapo", "clip-higher lets unlikely tokens gain probability"),),
    "truncation": (("dapo", "its overlong filtering keeps cut completions out of the loss"),),
    "zero_spread": (("dapo", "replaces flat groups with the next prompts"),
                    ("adagrpo", "samples a prompt with no correct completion again, hotter"),
                    ("agpo", "gives all-right and all-wrong groups a fixed advantage")),
}


def _presets(kind: str, config: dict) -> list[str]:
    """`--algo <preset> (why)` for the presets that help with `kind`, except the one the run already uses."""
    return [f"--algo {name} ({why})" for name, why in PRESET_REMEDIES.get(kind, ()) if name != config.get("algo")]


def _now(config: dict, name: str) -> str:
    value = config.get(name)
    return f" (now {value:g})" if _number(value) is not None else ""


def _reward_hacking(train: list[dict], evals: list[dict], config: dict) -> HealthWarning | None:
    """Held-out accuracy at the last evaluation below the best earlier one by more than ACCURACY_DROP_MIN and NOISE_Z
    standard errors of the difference, while the training reward rose between them: its mean over the last steps
    before the last evaluation above its mean over the first steps after the best one (WINDOW steps each, or half
    of the steps between when there are fewer)."""
    if len(evals) < 2 or not train:
        return None
    last = evals[-1]
    best = max(evals[:-1], key=lambda e: e["eval/accuracy"])
    drop = best["eval/accuracy"] - last["eval/accuracy"]
    variance = 0.0
    for e in (best, last):
        p, n = e["eval/accuracy"], _number(e.get("eval/num_problems")) or 0.0
        variance += p * (1 - p) / n if n > 0 else 0.0
    noise = NOISE_Z * math.sqrt(variance)
    if drop <= max(ACCURACY_DROP_MIN, noise):
        return None
    between = [m for m in train if best["step"] < m["step"] <= last["step"]]
    k = min(WINDOW, len(between) // 2)
    if k == 0:
        return None
    before, after = between[:k], between[-k:]
    r_before, r_after = _mean(before, "reward"), _mean(after, "reward")
    if r_before is None or r_after is None or r_after <= r_before:
        return None
    n = int(_number(last.get("eval/num_problems")) or 0)
    evidence = (f"held-out accuracy {best['eval/accuracy']:.3f} at step {best['step']} -> {last['eval/accuracy']:.3f} "
                f"at step {last['step']} ({-100 * drop:+.1f} points on {n} problems, noise +-{100 * noise:.1f}) while "
                f"the training reward rose {r_before:.3f} -> {r_after:.3f} ({_steps(before)} against {_steps(after)})")
    funcs = config.get("reward_funcs") or []
    others = [f for f in funcs if f != "accuracy"]
    beta = _number(config.get("beta"))
    better = "the starting model (step 0)" if best["step"] == 0 else f"the checkpoint nearest step {best['step']}"
    advice = (f"read the completions since step {best['step']} with reward above {r_before:.2f} (completions browser) "
              f"for answers that satisfy the reward without solving the task; "
              + ("a reward that checks the answer (--reward_funcs accuracy ...); " if funcs and "accuracy" not in funcs
                 else f"lower --reward_weights on {', '.join(others)}; " if others else "")
              + f"keep the policy nearer its reference (--beta {2 * beta if beta else 0.04:g}, or --algo agrpo for a "
              f"KL held at a target); {better} scored better")
    return HealthWarning("reward_hacking", "reward rising while held-out accuracy falls (reward hacking?)",
                         best["step"], train[-1]["step"], evidence, advice,
                         {"severity": drop, "best_step": best["step"], "best_accuracy": best["eval/accuracy"],
                          "last_step": last["step"], "last_accuracy": last["eval/accuracy"], "noise": noise,
                          "reward_before": r_before, "reward_after": r_after})


def _entropy_collapse(train: list[dict], config: dict) -> HealthWarning | None:
    if len(train) < 2 * WINDOW:
        return None
    early, recent = train[:WINDOW], train[-WINDOW:]
    h0, h = _mean(early, "entropy"), _mean(recent, "entropy")
    if h0 is None or h is None or h0 <= 0 or h >= ENTROPY_COLLAPSE_RATIO * h0:
        return None
    temperature = _number(config.get("temperature"))
    hotter = f"--temperature {min(2 * temperature, 1.0):g}" if temperature and temperature < 1.0 else \
        "a higher --temperature"
    advice = ", ".join([*_presets("entropy_collapse", config), hotter,
                        f"an entropy bonus (--eta 0.001{_now(config, 'eta')}; --algo agrpo sets one), or one that "
                        f"follows the entropy (--use_adaptive_entropy true --entropy_target <nats>)",
                        f"a lower --learning_rate{_now(config, 'learning_rate')}"])
    return HealthWarning("entropy_collapse", "policy entropy collapsing", recent[0]["step"], recent[-1]["step"],
                         f"entropy {h:.3f} nats/token over {_steps(recent)}, {100 * h / h0:.0f}% of the {h0:.3f} of "
                         f"{_steps(early)}: sampling is close to greedy, so groups lose their reward spread and the "
                         f"gradient with it", advice, {"severity": 1 - h / h0, "entropy": h, "entropy_start": h0})


def _truncation(train: list[dict], config: dict) -> HealthWarning | None:
    recent = train[-WINDOW:]
    share = _mean(recent, "completions/clipped_ratio")
    if len(recent) < WINDOW or share is None or share <= MOST:
        return None
    cap = config.get("max_completion_length")
    length = _mean(recent, "completions/mean_length")
    longer = f"--max_completion_length {2 * cap}" if isinstance(cap, int) else "a longer --max_completion_length"
    advice = ", ".join([f"{longer} (now {cap})" if isinstance(cap, int) else longer,
                        f"a lower --temperature{_now(config, 'temperature')}", *_presets("truncation", config)])
    mean = f" (mean length {length:.1f} tokens)" if length is not None else ""
    return HealthWarning("truncation", "most completions truncated", recent[0]["step"], recent[-1]["step"],
                         f"{100 * share:.0f}% of completions over {_steps(recent)} were cut at max_completion_length"
                         f"{mean}: a cut completion has no final answer and scores as wrong", advice,
                         {"severity": share, "share": share, "mean_length": length})


def _zero_spread(train: list[dict], config: dict) -> HealthWarning | None:
    recent = train[-WINDOW:]
    share = _mean(recent, "frac_reward_zero_std")
    if len(recent) < WINDOW or share is None or share <= MOST:
        return None
    reward = _mean(recent, "reward")
    group = _number(config.get("num_generations")) or _mean(recent, "num_generations")
    more = f"--num_generations {2 * int(group)} (now {int(group)})" if group else "more --num_generations"
    level = "" if reward is None else f"; mean reward {reward:.3f}" + (
        ": the reward is nearly saturated (prompts easy for the model, or a reward easy to earn)" if reward > 0.8
        else ": most completions score near 0 (prompts hard for the model)" if reward < 0.2 else "")
    return HealthWarning("zero_spread", "most groups have zero reward spread", recent[0]["step"], recent[-1]["step"],
                         f"{100 * share:.0f}% of groups over {_steps(recent)} gave all their completions the same "
                         f"reward, so their advantages are 0 and they teach nothing{level}",
                         ", ".join([more, *_presets("zero_spread", config)]),
                         {"severity": share, "share": share, "reward": reward})


def _kl_above_target(train: list[dict], config: dict) -> HealthWarning | None:
    """Only for a run with A-GRPO's KL controller (adaptive_kl), the one that has a target."""
    target = _number(config.get("kl_target"))
    recent = train[-WINDOW:]
    ema = _mean(recent, "kl_ema")
    if not config.get("adaptive_kl") or not target or len(recent) < WINDOW or ema is None or \
            ema <= KL_TARGET_FACTOR * target:
        return None
    beta = _number(recent[-1].get("next_beta", recent[-1].get("beta")))
    beta_max, rate = _number(config.get("beta_max")), _number(config.get("kl_beta_rate"))
    if beta is not None and beta_max is not None and beta >= 0.999 * beta_max:
        cause = f"beta_t is at beta_max {beta_max:g}: the controller cannot push harder"
        advice = f"a higher --beta_max (now {beta_max:g}), or a lower --learning_rate{_now(config, 'learning_rate')}"
    else:
        growth = f", and grows at most {100 * rate * 0.2:.0f}% a step (kl_beta_rate {rate:g} x the error, " \
                 f"clipped at 0.2)" if rate is not None else ""
        cause = f"beta_t is {beta:.3g}{growth}" if beta is not None else "beta_t has not caught up"
        advice = ", ".join([f"a faster controller (--kl_beta_rate {2 * rate:g})" if rate else
                            "a faster controller (a higher --kl_beta_rate)",
                            f"a higher starting --beta{_now(config, 'beta')}",
                            f"a lower --learning_rate{_now(config, 'learning_rate')}"])
    return HealthWarning("kl_above_target", "KL far above the controller's target", recent[0]["step"],
                         recent[-1]["step"], f"KL moving average {ema:.3f} over {_steps(recent)} is "
                         f"{ema / target:.1f}x kl_target {target:g}; {cause}", advice,
                         {"severity": ema / target, "kl_ema": ema, "kl_target": target, "beta": beta})


def main(argv: list[str] | None = None) -> None:
    """`python -m lib.apps.health RUN_FOLDER...`: for each run folder (metrics.jsonl and config.yaml), the stretches of
    steps where each warning held, and the warnings that hold at its last step with their numbers and advice."""
    import argparse
    from pathlib import Path


    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("runs", nargs="+", type=Path)
    for folder in parser.parse_args(argv).runs:
        if not (folder / METRICS).exists():
            print(f"{folder}: no metrics.jsonl (not a run folder, or the run has not logged a step yet)")
            continue
        lines, _ = read_jsonl(folder / METRICS)  # a line being written is skipped
        config = read_config(folder)
        spans = ", ".join(f"{w.kind} {w.steps.removeprefix('steps ').removeprefix('step ')}"
                          for w in episodes(lines, config))
        print(f"{folder}: {len(split_lines(lines)[0])} training steps; held: {spans or 'none'}")
        for warning in check(lines, config):
            print("  now: " + console_line(warning))


if __name__ == "__main__":
    main()
