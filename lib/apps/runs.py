"""Reading run folders while they are written, for the run view of chat_app.py (docs/watching.md).

A run folder is what train_agrpo.py writes (README "Run directory"): config.yaml, metrics.jsonl (training lines with
`reward`, evaluation lines with `eval/...`), completions.jsonl, checkpoint-<step>/ and final/. Any of them may be
missing (a run that is still loading its model, one that has not saved yet) and the last line of a JSONL file may be
half written; none of that is an error here. The functions return plain data: the page turns it into plots, tables
and text, and lib/apps/health.py checks the metric lines.
"""

from __future__ import annotations

import fnmatch
import functools
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from lib.checkpoint import list_checkpoints

METRICS, COMPLETIONS, CONFIG = "metrics.jsonl", "completions.jsonl", "config.yaml"
TOKENS_PER_SECOND = "throughput/tokens_per_second"  # derived: generated tokens / wall time of the logged steps


# ---------------------------------------------------------------------------------------------- files


def read_jsonl(path: str | Path) -> tuple[list[dict], int]:
    """(the JSON objects of a JSONL file, how many non-empty lines were not one). A line the writer has not finished
    (or that a kill cut) is counted, not raised; a missing file is ([], 0). The lists are shared between callers
    (cached on the file's size and modification time): do not change them."""
    try:
        stat = Path(path).stat()
    except OSError:
        return [], 0
    return _read_jsonl(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=32)
def _read_jsonl(path: str, size: int, mtime_ns: int) -> tuple[list[dict], int]:
    try:
        data = Path(path).read_bytes()
    except OSError:
        return [], 0
    records, bad = [], 0
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except (ValueError, RecursionError):  # half a line, bytes that are not UTF-8, absurd nesting
            bad += 1
            continue
        if isinstance(value, dict):
            records.append(value)
        else:
            bad += 1
    return records, bad


def read_config(folder: Path) -> dict:
    """A run's config.yaml as a dict ({} when it is missing or unreadable)."""
    try:
        config = yaml.safe_load((folder / CONFIG).read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return {}
    return config if isinstance(config, dict) else {}


def is_run(folder: Path) -> bool:
    return (folder / METRICS).is_file() or (folder / CONFIG).is_file()


def find_runs(folder: str | Path, depth: int = 4) -> list[Path]:
    """The run folders at or under `folder`: the folder itself if it holds metrics.jsonl or config.yaml, otherwise
    every such folder down to `depth` levels (a scripts/ablate.py output: runs/<method>/<ablation>/seed<seed>/),
    sorted. Checkpoints, final/ and hidden folders are not searched."""
    root = Path(os.path.expanduser(folder))
    if is_run(root):
        return [root]
    found: list[Path] = []
    level = [root]
    for _ in range(depth):
        below = []
        for parent in level:
            try:
                children = sorted(p for p in parent.iterdir() if p.is_dir())
            except OSError:
                continue
            for child in children:
                if child.name.startswith(".") or child.name == "final" or child.name.startswith("checkpoint-"):
                    continue
                (found if is_run(child) else below).append(child)
        level = below
    return sorted(found)


def signature(folders: list[Path]) -> tuple:
    """What changes when a run writes: the size and time of its files and its checkpoint list. Equal signatures:
    nothing to redraw."""
    parts = []
    for folder in folders:
        for name in (METRICS, COMPLETIONS, CONFIG):
            try:
                stat = (folder / name).stat()
                parts.append((str(folder), name, stat.st_size, stat.st_mtime_ns))
            except OSError:
                parts.append((str(folder), name, None, None))
        parts.append((str(folder), tuple(p.name for p in list_checkpoints(folder)), (folder / "final").is_dir()))
    return tuple(parts)


def labels_for(folders: list[Path]) -> list[str]:
    """A short distinct name per folder: the fewest trailing path parts that tell them apart."""
    parts = [Path(f).parts for f in folders]
    for k in range(1, max((len(p) for p in parts), default=1) + 1):
        labels = ["/".join(p[-k:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [str(f) for f in folders]


# ---------------------------------------------------------------------------------------------- a run


@dataclass(frozen=True)
class Run:
    folder: Path
    label: str
    exists: bool
    train: list[dict]  # training lines, in order, with TOKENS_PER_SECOND added
    evals: list[dict]  # evaluation lines
    config: dict
    checkpoints: list[int]  # steps of the complete checkpoints
    final: bool
    bad_lines: int  # lines of metrics.jsonl that are not JSON objects (the last one may be in the writing)

    @property
    def lines(self) -> list[dict]:
        """Training and evaluation lines in step order (an evaluation after the training line of its step)."""
        return sorted(self.train + self.evals, key=lambda m: (m.get("step", 0), "reward" not in m))


def load_run(folder: str | Path, label: str | None = None) -> Run:
    folder = Path(os.path.expanduser(folder))
    records, bad = read_jsonl(folder / METRICS)
    train = with_throughput([m for m in records if _number(m.get("reward")) is not None and "step" in m])
    evals = [m for m in records if _number(m.get("eval/accuracy")) is not None and "step" in m]
    steps = [int(p.name.split("-")[1]) for p in list_checkpoints(folder)]
    return Run(folder, label or folder.name, folder.is_dir(), train, evals, read_config(folder), steps,
               (folder / "final").is_dir(), bad)


def with_throughput(train: list[dict]) -> list[dict]:
    """Copies of the training lines with TOKENS_PER_SECOND: the tokens generated since the previous logged line over
    the wall time of the steps between (with logging_steps > 1 the logged step's time stands for each of them)."""
    out, tokens, step = [], 0.0, 0
    for m in train:
        now, seconds = _number(m.get("num_tokens")), _number(m.get("step_time"))
        extra = {}
        if now is not None and seconds and m["step"] > step:
            extra[TOKENS_PER_SECOND] = (now - tokens) / (seconds * (m["step"] - step))
        out.append({**m, **extra})
        tokens, step = (now if now is not None else tokens), m["step"]
    return out


def status(run: Run, where: str | None = None) -> str:
    """One line on what a run folder holds so far, or what is missing and what to do; `where`: the folder as the
    reader knows it (default: its path)."""
    where = where or str(run.folder)
    if not run.exists:
        return (f"**{run.label}**: no run here yet ('{where}' does not exist). Start one with "
                f"`python train_agrpo.py --output_dir {where}`; this view picks it up as it writes.")
    if not run.train and not run.evals:
        what = "no metrics.jsonl yet" if not (run.folder / METRICS).exists() else "no complete line yet"
        return (f"**{run.label}**: {what} (the run is loading its model or scoring step 0); the curves appear with "
                f"the first logged step.")
    max_steps = run.config.get("max_steps")
    parts = [f"**{run.label}**: steps {run.train[0]['step']}-{run.train[-1]['step']}"
             f"{f' of {max_steps}' if max_steps else ''} ({len(run.train)} logged)" if run.train else
             f"**{run.label}**: no training step logged yet"]
    if run.evals:
        last = run.evals[-1]
        parts.append(f"{len(run.evals)} evaluation(s), the last at step {last['step']}: accuracy "
                     f"{last['eval/accuracy']:.3f}")
    parts.append(f"checkpoints: {', '.join(map(str, run.checkpoints))}" if run.checkpoints else
                 "no checkpoint yet")
    if run.final:
        parts.append("final/ written")
    if run.bad_lines:
        parts.append(f"{run.bad_lines} incomplete line(s) of metrics.jsonl skipped (being written, or cut by a kill)")
    return " · ".join(parts)


# ---------------------------------------------------------------------------------------------- curves


@dataclass(frozen=True)
class PanelSpec:
    name: str
    title: str
    unit: str
    keys: tuple[str, ...]  # metric keys, fnmatch patterns allowed; the order is the legend's


# Each plot: its metric keys, a title and the unit of its y axis (docs/watching.md 2 lists them with their sources).
PANELS = (
    PanelSpec("reward", "Reward: total and per function", "reward (mean over completions)",
              ("reward", "rewards/*/mean")),
    PanelSpec("accuracy", "Held-out accuracy (greedy, eval_steps)", "fraction of held-out problems",
              ("eval/accuracy", "eval/format")),
    PanelSpec("kl", "KL to the reference model", "nats per token", ("kl",)),
    PanelSpec("entropy", "Policy entropy", "nats per token", ("entropy", "entropy/trained")),
    PanelSpec("length", "Completion length", "tokens", ("completions/mean_length", "completions/min_length",
                                                         "completions/max_length", "eval/mean_length")),
    PanelSpec("truncated", "Truncated completions (cut at max_completion_length)", "fraction of completions",
              ("completions/clipped_ratio", "eval/truncated_ratio")),
    PanelSpec("clip", "Clipped tokens (ratio outside the clip range)", "fraction of tokens", ("clip_ratio/*",)),
    PanelSpec("masked", "Tokens left out of the policy loss (entropy and off-policy masks)", "fraction of tokens",
              ("masked/*",)),
    PanelSpec("grad_norm", "Gradient norm (before clipping)", "L2 norm", ("grad_norm",)),
    PanelSpec("zero_spread", "Groups with zero reward spread", "fraction of groups", ("frac_reward_zero_std",)),
    PanelSpec("reward_std", "Reward spread", "standard deviation of the reward", ("reward_std", "rewards/*/std")),
    PanelSpec("throughput", "Throughput", "generated tokens per second", (TOKENS_PER_SECOND,)),
    PanelSpec("time", "Time per step and per phase", "seconds", ("step_time", "time/*")),
    PanelSpec("loss", "Loss", "loss (loss_type's normalisation)", ("loss",)),
    PanelSpec("learning_rate", "Learning rate", "learning rate", ("learning_rate",)),
    PanelSpec("beta", "KL coefficient beta (A-GRPO: beta_t)", "beta", ("beta", "next_beta")),
    PanelSpec("epsilon", "Clip range epsilon (A-GRPO: epsilon_t; AGPO-DSF: per-group band)", "epsilon",
              ("epsilon", "next_epsilon", "epsilon/group_min", "epsilon/group_max")),
    PanelSpec("kl_ema", "A-GRPO: KL moving average against its target", "nats per token",
              ("kl_ema",)),
    PanelSpec("eta", "Entropy bonus coefficient eta (adaptive: use_adaptive_entropy)", "eta",
              ("eta", "entropy_coef")),
    PanelSpec("temperature", "Sampling temperature (token mean; per-prompt band where logged)", "temperature",
              ("temperature", "temperature/group_min", "temperature/group_max")),
    PanelSpec("group_size", "Group size", "completions per prompt", ("num_generations", "next_num_generations")),
    PanelSpec("zero_std_ema", "A-GRPO: zero-spread moving average (group size controller)", "fraction of groups",
              ("zero_std_ema",)),
    PanelSpec("dynamic_sampling", "DAPO dynamic sampling", "per generation batch",
              ("dynamic_sampling/rounds", "dynamic_sampling/replaced_groups")),
    PanelSpec("resampling", "adaGRPO resampling", "per generation batch", ("resample_rounds", "resampled_prompts")),
    PanelSpec("extra_tokens", "Tokens sampled but not trained on (probes, dropped and discarded rounds)",
              "tokens per generation batch", ("num_tokens/*",)),
    PanelSpec("dsf_step_kl", "AGPO-DSF: step KL moving average", "nats per token", ("step_kl_ema",)),
    PanelSpec("dsf_entropy", "AGPO-DSF: entropy reference", "nats per token", ("entropy_ref",)),
    PanelSpec("dsf_probe", "AGPO-DSF: probe group statistics", "nats (vote entropy) / reward (spread)",
              ("vote_entropy", "probe_reward_std")),
    PanelSpec("dsf_uncertainty", "AGPO-DSF: uncertainty baseline", "uncertainty score", ("uncertainty_baseline",)),
    PanelSpec("errors", "Reward errors and skipped steps", "count per step",
              ("rewards/*/errors", "nonfinite/*", "nonfinite_skipped", "update_skipped")),
    PanelSpec("sampling", "vLLM importance sampling", "ratio / log-prob difference", ("sampling/*",)),
)
TIMELINE_KEYS = ("time/sample_start", "time/sample_end", "time/train_start", "time/train_end")  # clock readings
# the x axes, the evaluation's size, and the timeline's clock readings (seconds since the start, not durations)
NOT_PLOTTED = ("step", "num_tokens", "eval/num_problems", *TIMELINE_KEYS)
LABELS = {  # legend names within a plot; the rest: the key, less a prefix the plot's title already says
    "reward": "total", "reward_std": "total", TOKENS_PER_SECOND: "tokens/s",
    "eval/accuracy": "accuracy", "eval/format": "answer line present",
    "completions/mean_length": "mean", "completions/min_length": "min", "completions/max_length": "max",
    "eval/mean_length": "held-out mean", "completions/clipped_ratio": "training", "eval/truncated_ratio": "held-out",
    "clip_ratio/low_mean": "below 1-eps (A<0)", "clip_ratio/high_mean": "above 1+eps (A>0)",
    "clip_ratio/region_mean": "either", "clip_ratio/dual_mean": "dual clip",
    "step_time": "whole step", "beta": "this step", "next_beta": "next step", "epsilon": "this step (mean)",
    "next_epsilon": "next step", "kl_ema": "moving average", "kl_target": "kl_target",
    "entropy": "completion tokens", "entropy/trained": "trained tokens", "entropy_target": "entropy_target",
    "eta": "this step", "entropy_coef": "next step",
    "epsilon/group_min": "per-group min", "epsilon/group_max": "per-group max",
    "temperature/group_min": "per-prompt min", "temperature/group_max": "per-prompt max",
    "temperature": "token mean", "num_generations": "this batch", "next_num_generations": "next batch",
    "dynamic_sampling/rounds": "rounds", "dynamic_sampling/replaced_groups": "replaced groups",
    "resample_rounds": "rounds", "resampled_prompts": "prompts resampled",
    "nonfinite_skipped": "non-finite: step skipped", "update_skipped": "no signal: update skipped",
}


def series_label(key: str) -> str:
    """The legend name of a metric key within its plot."""
    if key in LABELS:
        return LABELS[key]
    match = re.fullmatch(r"rewards/(.+)/(mean|std|errors)", key)
    if match:
        return match.group(1) + (": raised" if match.group(2) == "errors" else "")
    if key.startswith("nonfinite/rewards/"):
        return key[len("nonfinite/rewards/"):] + ": not finite"
    for prefix in ("time/", "num_tokens/", "sampling/"):
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


@dataclass(frozen=True)
class Panel:
    name: str
    title: str
    unit: str
    rows: list[tuple[float, float, str]]  # (x, y, series)

    @property
    def points(self) -> int:
        return len(self.rows)


def panels(runs: list[Run], x: str = "step") -> tuple[list[Panel], dict[str, str]]:
    """The plots for `runs` overlaid, x = "step" or "num_tokens" (generated tokens, for equal-budget comparisons),
    and the fields left out because they are constant in every run ({key: value(s)}). A metric is drawn when it
    varies in at least one run; then every run that logs it is drawn, so a fixed value shows beside an adaptive one.
    Metrics no panel names get a plot of their own. A series is named by its metric, or by its run and metric when
    there are several runs."""
    keys: dict[str, None] = {}  # every numeric key, in the order first seen
    for run in runs:
        for m in run.train + run.evals:
            keys.update((k, None) for k, v in m.items() if _number(v) is not None and k not in NOT_PLOTTED)
    varying, constant = {}, {}
    for key in keys:
        values = [[v for v in (_number(m.get(key)) for m in run.train + run.evals) if v is not None] for run in runs]
        if any(_varies(v) for v in values):
            varying[key] = None
        else:
            constant[key] = " / ".join(dict.fromkeys(f"{v[0]:.6g}" for v in values if v))
    specs = list(PANELS)
    claimed = {k for spec in specs for k in varying if any(fnmatch.fnmatchcase(k, p) for p in spec.keys)}
    specs += [PanelSpec(k, k, "as logged", (k,)) for k in varying if k not in claimed]
    out = []
    for spec in specs:
        members = [k for pattern in spec.keys for k in varying if fnmatch.fnmatchcase(k, pattern)]
        members = list(dict.fromkeys(members))
        if not members:
            continue
        rows = []
        for run in runs:
            for key in members:
                rows += [(px, y, _series(run, key, runs)) for px, y in _points(run, key, x)]
            if spec.name == "kl_ema" and "kl_ema" in members and run.config.get("adaptive_kl"):
                rows += _target_line(run, x, runs, "kl_target")
            if spec.name == "entropy" and run.config.get("use_adaptive_entropy"):
                rows += _target_line(run, x, runs, "entropy_target")
        if rows:
            out.append(Panel(spec.name, spec.title, spec.unit, rows))
    return out, constant


def _varies(values: list[float]) -> bool:
    """More than float32 rounding apart (a temperature logged as 0.69999987 and 0.7 is constant)."""
    return bool(values) and max(values) - min(values) > 1e-5 * max(abs(max(values)), abs(min(values)))


def _series(run: Run, key: str, runs: list[Run]) -> str:
    return f"{run.label}: {series_label(key)}" if len(runs) > 1 else series_label(key)


def _x_of(run: Run, x: str):
    """step -> x value: the step itself, or the generated tokens at the last training line at or before it."""
    if x == "step":
        return lambda step: float(step)
    marks = [(m["step"], _number(m.get("num_tokens"))) for m in run.train if _number(m.get("num_tokens")) is not None]

    def tokens(step):
        before = [t for s, t in marks if s <= step]
        return before[-1] if before else 0.0
    return tokens


def _points(run: Run, key: str, x: str) -> list[tuple[float, float]]:
    to_x = _x_of(run, x)
    lines = run.evals if key.startswith("eval/") else run.train
    return [(to_x(m["step"]), y) for m in lines if (y := _number(m.get(key))) is not None]


def _target_line(run: Run, x: str, runs: list[Run], key: str) -> list[tuple[float, float, str]]:
    """A controller's target (`key` in the run's config) as a flat line across its steps."""
    target = _number(run.config.get(key))
    if target is None or not run.train:
        return []
    to_x = _x_of(run, x)
    name = _series(run, key, runs)
    return [(to_x(run.train[0]["step"]), target, name), (to_x(run.train[-1]["step"]), target, name)]


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(
        value) else None


# ---------------------------------------------------------------------------------------------- timeline


@dataclass(frozen=True)
class Bar:
    """When a generation batch was sampled (lane "sampling") or an optimizer step trained (lane "training"), in
    seconds since the run's sampling pipeline started (lib/sampling/pipeline.py's clock)."""

    lane: str
    batch: int  # the generation batch (sampled, or trained on), from 0 as lib/sampling/pipeline.py counts them
    step: int  # the optimizer step (trained), or the batch's first step (sampled)
    start: float
    end: float
    staleness: int | None  # the step's: optimizer steps between the weights that sampled its batch and its own

    @property
    def name(self) -> str:
        return f"batch {self.batch}" if self.lane == "sampling" else f"step {self.step}"


@dataclass(frozen=True)
class Timeline:
    bars: list[Bar]  # by start time
    steps: tuple[int, int]  # the first and last step drawn
    left_out: int  # logged steps before them: older than the window, or before the run's last (re)start
    restarted: bool  # the run resumed: its clock restarted, and only the lines since are drawn

    @property
    def overlap(self) -> float:
        """Seconds during which a batch was sampled while a step trained (0 for a synchronous run)."""
        sampling = [b for b in self.bars if b.lane == "sampling"]
        return sum(max(0.0, min(s.end, t.end) - max(s.start, t.start))
                   for t in self.bars if t.lane == "training" for s in sampling)

    @property
    def sampling_seconds(self) -> float:
        return sum(b.end - b.start for b in self.bars if b.lane == "sampling")


def steps_per_batch(config: dict) -> int:
    """Optimizer steps one generation batch serves, from config.yaml: num_iterations x optimizer steps per generation
    (lib/settings.Config.optimizer_steps_per_generation); 1 where the keys are missing."""
    def whole(key, default):
        value = _number(config.get(key))
        return int(value) if value is not None and value >= 1 else default
    accumulation = whole("gradient_accumulation_steps", 1)
    return whole("num_iterations", 1) * max(1, whole("steps_per_generation", accumulation) // accumulation)


def timeline(run: Run, window: int | None = None) -> Timeline | None:
    """The sampling and training bars of a run's newest `window` logged steps (None: all of them), or None for a run
    that does not log them (older runs). Each training line holds its step's `time/train_start` and `_end`; the line
    of a batch's first step also holds the batch's `time/sample_start` and `_end` (a batch sampled ahead appears when
    that step is logged). A resumed run's clock starts again at 0: only the lines since its last start are drawn, and
    a batch sampled before the resume (kept in the checkpoint; it ends after its step started) is left out."""
    timed = [m for m in run.train if all(_number(m.get(k)) is not None for k in TIMELINE_KEYS[2:])]
    if not timed:
        return None
    start = 0
    for i in range(1, len(timed)):
        if timed[i]["time/train_start"] < timed[i - 1]["time/train_end"]:
            start = i
    kept = timed[start:][-window:] if window else timed[start:]
    per_batch = steps_per_batch(run.config)
    bars = []
    for m in kept:
        step, staleness = int(m["step"]), _number(m.get("staleness"))
        staleness = None if staleness is None else int(staleness)
        sampled = [_number(m.get(k)) for k in TIMELINE_KEYS[:2]]
        batch = (step - 1) // per_batch
        if None not in sampled and sampled[0] <= sampled[1] <= m["time/train_start"]:
            bars.append(Bar("sampling", batch, step, *sampled, staleness))
        bars.append(Bar("training", batch, step, m["time/train_start"], m["time/train_end"], staleness))
    bars.sort(key=lambda b: (b.start, b.lane))
    return Timeline(bars, (int(kept[0]["step"]), int(kept[-1]["step"])), len(timed) - len(kept), start > 0)


# ---------------------------------------------------------------------------------------------- completions


_MARKUP = re.compile(r"<\|[^<>|\n]{1,40}\|>|<(?:start|end)_of_turn>|\[/?INST\]|</?s>")
_TRAILER = re.compile(r"(?:\s|<\|[^<>|\n]{1,40}\|>|<(?:start|end)_of_turn>|\[/INST\]|</s>|\b(?:assistant|model)\b)+$")
_ROLE = re.compile(r"^\s*(?:user|human)\s*\n", re.IGNORECASE)


def problem_of(prompt: str, instruction: str | None = None, system_prompt: str | None = None) -> str:
    """The problem inside a logged prompt (the chat template's text, lib/data/records.format_prompt): the user turn's text
    without the instruction the trainer appended, so that it can be asked again in the chat (which appends it)."""
    text = prompt
    at = text.rfind("\n" + instruction) if instruction else -1
    text = text[:at] if at >= 0 else _TRAILER.sub("", text)
    marks = list(_MARKUP.finditer(text))
    if marks:
        text = text[marks[-1].end():]
    elif system_prompt and text.startswith(system_prompt + "\n"):  # a plain-text prompt (no chat template)
        text = text[len(system_prompt) + 1:]
    return _ROLE.sub("", text, count=1).strip()


def completion_rows(run: Run, split) -> list[dict]:
    """completions.jsonl of a run as table rows, newest first: step, problem, final answer (and the reasoning, by
    `split`, the chat's split_reasoning), gold answer, reward, advantage, the sampling temperature (the record's
    own, else the step's token mean from metrics.jsonl, marked `temperature_of` "step mean") and the reward per
    function where the record holds them ("rewards": {name: value}), and an agent's episode turn by turn where the
    record holds them ("turns": [{"role": "assistant" | "tool", "content": text}], docs/agents.md 6)."""
    records, _ = read_jsonl(run.folder / COMPLETIONS)
    step_temperature = {m["step"]: _number(m.get("temperature")) for m in run.train}
    instruction, system_prompt = run.config.get("instruction"), run.config.get("system_prompt")
    rows = []
    for i, r in enumerate(records):
        if not isinstance(r.get("completion"), str) or _number(r.get("step")) is None:
            continue
        reasoning, final = split(r["completion"])
        own = _number(r.get("temperature"))
        rewards = r.get("rewards") if isinstance(r.get("rewards"), dict) else {}
        rows.append({"index": i, "step": int(r["step"]), "prompt": str(r.get("prompt", "")),
                     "problem": problem_of(str(r.get("prompt", "")), instruction, system_prompt),
                     "completion": r["completion"], "reasoning": reasoning, "final": final,
                     "answer": "" if r.get("answer") is None else str(r.get("answer")),
                     "reward": _number(r.get("reward")), "advantage": _number(r.get("advantage")),
                     "temperature": own if own is not None else step_temperature.get(int(r["step"])),
                     "temperature_of": "completion" if own is not None else "step mean",
                     "rewards": {str(k): _number(v) for k, v in rewards.items()},
                     "turns": r["turns"] if isinstance(r.get("turns"), list) else None})
    return rows[::-1]


SIGNS = ("any", "> 0", "= 0", "< 0")


def filter_completions(rows: list[dict], step_min=None, step_max=None, reward_min=None, reward_max=None,
                       sign: str = "any") -> list[dict]:
    """The rows within the step range and reward bounds (None: no bound) whose advantage has `sign` (SIGNS)."""
    def keep(row) -> bool:
        reward, advantage = row["reward"], row["advantage"]
        if step_min is not None and row["step"] < step_min or step_max is not None and row["step"] > step_max:
            return False
        if (reward_min is not None or reward_max is not None) and reward is None:
            return False
        if reward_min is not None and reward < reward_min or reward_max is not None and reward > reward_max:
            return False
        if sign != "any":
            if advantage is None:
                return False
            return {"> 0": advantage > 0, "= 0": advantage == 0, "< 0": advantage < 0}[sign]
        return True

    if sign not in SIGNS:
        raise ValueError(f"advantage sign must be one of {SIGNS}, got {sign!r}")
    return [row for row in rows if keep(row)]


def nearest_checkpoint(run: Run, step: int) -> str | None:
    """The checkpoint folder name nearest the policy that sampled `step`'s completions (the weights after step - 1),
    the earlier one on a tie; final/ when the run has no checkpoint but a final model; None when it has neither."""
    if run.checkpoints:
        best = min(run.checkpoints, key=lambda s: (abs(s - (step - 1)), s))
        return f"checkpoint-{best}"
    return "final" if run.final else None
