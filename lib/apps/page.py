"""The chat page's parts that need no Gradio (chat_app.py builds the page from them): the reasoning split and the
chat messages, the page's input checks (folders inside the allowed roots, the login, conversation files), and the
run view's data shaping (which runs, their warnings, the completions table). docs/watching.md describes the page."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from types import SimpleNamespace

import yaml
from transformers import GenerationConfig

from lib.checkpoint import list_checkpoints
from lib.data.records import DEFAULT_INSTRUCTION
from lib.apps import health
from lib.apps import runs as run_data
from lib.models.embedded import EMBEDDED_ALIASES
from lib.config import setting
from lib.rewards.functions import extract_answer
from lib.rewards.open_r1 import REWARD_OPTION_KEYS, reward_options

CONVERSATION_FORMAT = "agrpo-chat/1"


def split_reasoning(text: str) -> tuple[str, str]:
    """(reasoning, final answer) of a completion: a `<think>...</think>` block and what follows it (inside
    `<answer>` tags if there are any); otherwise the text before the last `Answer:` line and the answer on it;
    otherwise all of it is reasoning and the answer is what the answer extractor finds (the last number), or ''."""
    if "</think>" in text:
        reasoning, _, rest = text.partition("</think>")
        reasoning = reasoning.replace("<think>", "").strip()
        rest = rest.strip()
        if "<answer>" in rest:
            rest = rest.split("<answer>", 1)[1].split("</answer>", 1)[0]
        return reasoning, rest.strip()
    lines = text.rstrip().splitlines()
    for i in range(len(lines) - 1, -1, -1):
        at = lines[i].lower().rfind("answer:")
        if at >= 0:
            before = "\n".join([*lines[:i], lines[i][:at].rstrip("* ")]).strip()
            return before, lines[i][at + len("answer:") :].strip(" *") or (extract_answer(text) or "")
    return text.strip(), extract_answer(text) or ""


def assistant_messages(text: str, *, streaming: bool = False) -> list[dict]:
    """Chat messages for one answer: a collapsible 'Reasoning' block, then the final answer."""
    reasoning, answer = split_reasoning(text)
    messages = []
    if reasoning:
        messages.append({"role": "assistant", "content": reasoning,
                         "metadata": {"title": "Reasoning", "status": "pending" if streaming else "done"}})
    if answer or not streaming:
        messages.append({"role": "assistant", "content": f"**Final answer:** {answer}" if answer
                         else "_(no final answer)_"})
    return messages


def episode_key(side: str) -> str:
    """The key of a turn that holds one side's episode with tools (its messages, docs/agents.md 6)."""
    return f"{side}_episode"


def chat_view(turns: list[dict], side: str) -> list[dict]:
    """The chatbot messages of one side (`checkpoint` or `base`) for a list of turns: an answer with tools turn by
    turn (`episode_messages`), one without as its reasoning and final answer."""
    messages = []
    for turn in turns:
        messages.append({"role": "user", "content": turn["prompt"]})
        streaming = turn.get("streaming", False)
        if turn.get(episode_key(side)):
            messages += episode_messages(turn[episode_key(side)], streaming=streaming)
        elif turn.get(side) is not None:
            messages += assistant_messages(turn[side], streaming=streaming)
    return messages


def model_messages(turns: list[dict], side: str, prompt: str, instruction: str, system_prompt: str | None):
    """The conversation a model sees: every earlier prompt (with the instruction, as in training), its own earlier
    answers (an answer with tools as its turns and the tools' results, in the template's `tool` messages), and the
    new prompt."""
    def user(text: str) -> dict:
        return {"role": "user", "content": f"{text}\n{instruction}" if instruction else text}

    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    for turn in turns:
        messages.append(user(turn["prompt"]))
        if turn.get(episode_key(side)):
            messages += [{"role": m["role"], "content": m["content"]} for m in turn[episode_key(side)]]
        else:
            messages.append({"role": "assistant", "content": turn.get(side) or ""})
    return messages + [user(prompt)]


def reward_line(rewards: dict[str, float] | None) -> str:
    if not rewards:
        return ""
    return "reward: " + " · ".join(f"{name} {value:g}" for name, value in rewards.items())


def run_folder_of(path: str) -> Path | None:
    """The run directory a checkpoint or final/ folder belongs to (it holds config.yaml), or None."""
    folder = Path(path).expanduser()
    for candidate in (folder, folder.parent):
        if (candidate / "config.yaml").exists():
            return candidate
    return None


def checkpoint_choices(run_dir: str) -> list[str]:
    """'final' and every complete checkpoint-<step> of a run folder, newest first."""
    root = Path(run_dir).expanduser()
    choices = [p.name for p in reversed(list_checkpoints(root))]
    if (root / "final").is_dir():
        choices.insert(0, "final")
    return choices


def run_settings(run_dir: Path | None) -> dict:
    """The starting model, instruction, system prompt and tools a run trained with (its config.yaml), where
    known."""
    if run_dir is None:
        return {}
    try:
        config = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        return {}
    keys = ("model_name_or_path", "instruction", "system_prompt", "tools", "max_tool_calling_iterations",
            "tool_timeout", "environment_factory", *REWARD_OPTION_KEYS)
    return {k: config[k] for k in keys if k in config}


def reward_options_of(settings: dict) -> dict:
    """The built-in rewards' options (cosine, soft_overlong, repetition) as the run trained with them: the keys its
    config.yaml gives (`run_settings`), the trainer's defaults for the others (lib/config.setting), made into options
    by the trainer's own lib/rewards/open_r1.reward_options."""
    given = SimpleNamespace(**{k: settings[k] for k in REWARD_OPTION_KEYS if k in settings})
    return reward_options(SimpleNamespace(**{k: setting(given, k) for k in REWARD_OPTION_KEYS}))


def generation_config(greedy: bool, temperature: float, top_p: float, max_new_tokens: int,
                      eos_token_ids: list[int], pad_token_id: int) -> GenerationConfig:
    """The page's sampling settings as a generation config; ValueError names a setting out of range."""
    if int(max_new_tokens) < 1:
        raise ValueError(f"max new tokens must be >= 1, got {max_new_tokens}")
    if not greedy and not float(temperature) > 0:
        raise ValueError(f"temperature must be > 0 when sampling (or tick greedy), got {temperature}")
    if not greedy and not 0 < float(top_p) <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    kwargs = {"max_new_tokens": int(max_new_tokens), "eos_token_id": eos_token_ids, "pad_token_id": pad_token_id}
    if greedy:
        kwargs["do_sample"] = False
    else:
        kwargs.update(do_sample=True, temperature=float(temperature), top_p=float(top_p))
    config = GenerationConfig(**kwargs)
    config.validate(strict=True)
    return config


LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


AUTH_ENV = "AGRPO_CHAT_AUTH"


MAX_UPLOAD_BYTES = 10 * 2**20  # a saved conversation of a few hundred turns is well under 1 MB


class PageInputError(ValueError):
    """Input the page refuses, with the message it shows."""


def parse_auth(text: str | None, source: str) -> tuple[str, str] | None:
    """(user, password) from 'USER:PASSWORD'; SystemExit names the source, never the password."""
    if text is None:
        return None
    user, sep, password = text.partition(":")
    if not sep or not user or not password:
        raise SystemExit(f"error: {source}: expected USER:PASSWORD with both parts non-empty; give e.g. "
                         f"--auth alice:a-long-password (or set {AUTH_ENV})")
    return user, password


def exposure(args: argparse.Namespace) -> tuple[str, str] | None:
    """The login the page needs, from --auth or $AGRPO_CHAT_AUTH; SystemExit when the page would be reachable
    beyond this machine (another --host, or --share) with neither a login nor --no_auth_i_know."""
    auth = parse_auth(args.auth, "--auth") if args.auth is not None else parse_auth(os.environ.get(AUTH_ENV),
                                                                                     f"${AUTH_ENV}")
    if (args.host not in LOCAL_HOSTS or args.share) and auth is None and not args.no_auth_i_know:
        where = "--share (a public link)" if args.share else (
            f"--host {args.host}" if getattr(args, "host_source", "--host") == "--host"
            else f"{args.host_source}={args.host}")
        raise SystemExit(f"error: {where}: the page would be open to other machines without a login, and it loads "
                         f"and runs model folders; pass --auth USER:PASSWORD (or set {AUTH_ENV}=USER:PASSWORD), or "
                         f"--no_auth_i_know to expose it anyway")
    return auth


def allowed_roots(args: argparse.Namespace, name: str | None, base: str | None, run_dir: Path | None,
                  watched: list[str] | None = None) -> list[Path]:
    """The folders whose models and runs the page may list and load: the run folder, the model folders it was started
    with (an adapter's base included), the run folders it watches, and --allow_dir; resolved (symlinks and '..')."""
    roots = [run_dir] if run_dir else []
    roots += [Path(w) for w in watched or []]
    roots += [Path(n) for n in (name, base) if n and n not in EMBEDDED_ALIASES and Path(n).expanduser().is_dir()]
    roots += [Path(d) for d in args.allow_dir or []]
    resolved = []
    for root in roots:
        root = root.expanduser().resolve()
        if root not in resolved:
            resolved.append(root)
    return resolved


def check_inside(path: str, roots: list[Path], what: str) -> Path:
    """`path` resolved, if it lies in one of `roots`; PageInputError otherwise (symlinks and '..' followed first)."""
    try:
        resolved = Path(path).expanduser().resolve()
    except (OSError, ValueError, RuntimeError) as error:  # a NUL byte, a name too long, a symlink loop
        raise PageInputError(f"{what} '{path:.80}' is not a usable path ({error})") from None
    if any(resolved == root or root in resolved.parents for root in roots):
        return resolved
    allowed = ", ".join(str(r) for r in roots) or "none (the page was started on the embedded model)"
    raise PageInputError(f"{what} '{path:.80}' is outside the folders this page may open ({allowed}); start the page "
                         f"with --allow_dir FOLDER to add one")


def loadable(name: str, roots: list[Path], started: set[str]) -> str:
    """The name to load, if the page may load it: the embedded model, a name the page was started with, or a path
    inside the allowed folders. A hub id typed in the page is refused (the page would download and run it)."""
    name = name.strip()
    if name in EMBEDDED_ALIASES or name in started:
        return name
    return str(check_inside(name, roots, "the model folder"))


def read_conversation(file: str) -> dict:
    """A saved conversation's data, its turns and settings checked; PageInputError says what is wrong with it."""
    path = Path(file)
    size = path.stat().st_size
    if size > MAX_UPLOAD_BYTES:
        raise PageInputError(f"the file is {size / 2**20:.1f} MB; a saved conversation is under "
                             f"{MAX_UPLOAD_BYTES // 2**20} MB")
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as error:
        raise PageInputError(f"the file is not UTF-8 text (byte {error.start}); choose a conversation .json saved "
                             f"by this page") from None
    except (ValueError, RecursionError) as error:  # bad syntax, nesting too deep, an integer too long to read
        reason = error.msg if isinstance(error, json.JSONDecodeError) else "nested too deeply" \
            if isinstance(error, RecursionError) else str(error).split(";")[0]
        where = f" at line {error.lineno}, column {error.colno}" if isinstance(error, json.JSONDecodeError) else ""
        raise PageInputError(f"the file is not valid JSON ({reason}{where})") from None
    if not isinstance(data, dict) or data.get("format") != CONVERSATION_FORMAT or not isinstance(data.get("turns"),
                                                                                                 list):
        raise PageInputError(f"not a conversation saved by this page (format {CONVERSATION_FORMAT})")
    turns = []
    for i, turn in enumerate(data["turns"], start=1):
        if not isinstance(turn, dict) or not isinstance(turn.get("prompt"), str):
            raise PageInputError(f"turn {i} has no prompt text")
        for key in ("checkpoint", "base", "reference"):
            if turn.get(key) is not None and not isinstance(turn[key], str):
                raise PageInputError(f"turn {i}: '{key}' must be text, got {type(turn[key]).__name__}")
        for key in map(episode_key, ("checkpoint", "base")):
            episode = turn.get(key)
            if episode is not None and not (isinstance(episode, list) and all(
                    isinstance(m, dict) and m.get("role") in ("assistant", "tool") and isinstance(m.get("content"), str)
                    for m in episode)):
                raise PageInputError(f"turn {i}: '{key}' must be a list of {{\"role\": \"assistant\" or \"tool\", "
                                     f"\"content\": text}} messages")
        turns.append({k: v for k, v in turn.items() if k != "streaming"})
    saved = data.get("settings") if isinstance(data.get("settings"), dict) else {}

    def number(key, low, high, default, kind=float):
        value = saved.get(key, default)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value <= high
        return kind(value) if ok else default

    settings = {"greedy": saved["greedy"] if isinstance(saved.get("greedy"), bool) else True,
                "temperature": number("temperature", 0.05, 2.0, 0.7), "top_p": number("top_p", 0.05, 1.0, 1.0),
                "max_new_tokens": number("max_new_tokens", 8, 2048, 256, int)}
    instruction = data["instruction"] if isinstance(data.get("instruction"), str) else DEFAULT_INSTRUCTION
    return {"turns": turns, "settings": settings, "instruction": instruction}


TABLE_ROWS = 300  # completions shown at once, newest first


X_AXES = {"step": "step", "generated tokens": "num_tokens"}


def selected_runs(values: list[str] | None, roots: list[Path]) -> tuple[list[Path], list[str]]:
    """The run folders of the run view's selection: each typed or picked folder must lie inside `roots`; a folder of
    runs (a scripts/ablate.py output) stands for every run under it, and a folder that holds none yet stands for
    itself (a run that has not started writing). Returns (folders, messages for the refused ones)."""
    folders, messages = [], []
    for value in values or []:
        try:
            folder = check_inside(str(value).strip(), roots, "the run folder")
        except PageInputError as error:
            messages.append(str(error))
            continue
        for run in run_data.find_runs(folder) or [folder]:
            if run not in folders:
                folders.append(run)
    return folders, messages


def run_labels(folders: list[Path]) -> list[str]:
    """Names for the runs on the page: the last two parts of one run's path; the shortest distinct tails of several."""
    if len(folders) == 1:
        return ["/".join(folders[0].parts[-2:])]
    return run_data.labels_for(folders)


def warnings_markdown(run: run_data.Run) -> str:
    """A run's warnings (lib/apps/health.py): those that hold now, each with its numbers and what to try, then the
    stretches of steps where one held earlier."""
    lines = run.lines
    now = health.check(lines, run.config)
    last = run.train[-1]["step"] if run.train else 0
    earlier = [w for w in health.episodes(lines, run.config) if w.step < last]
    if not now and not earlier:
        return ""
    out = [f"**{run.label}**"]
    out += [f"- ⚠ **{w.title}** ({w.steps}): {w.evidence}.  \n  _Try:_ {w.advice}." for w in now]
    if earlier:
        out.append("- earlier: " + "; ".join(f"{w.title} ({w.steps})" for w in earlier))
    return "\n".join(out)


def constants_markdown(constant: dict[str, str]) -> str:
    if not constant:
        return ""
    return "Constant, not plotted: " + ", ".join(f"`{k}` {v}" for k, v in sorted(constant.items()))


TIMELINE_STEPS = 50  # the newest logged steps a timeline draws (its plot keeps under 1000 points, bars stay wide)
TIMELINE_COLUMNS = ["seconds", "lane", "slot", "detail"]
LANE_COLORS = {"sampling": ("#4c78a8", "#8cb0d8"), "training": ("#f58518", "#fbb86a")}  # two shades a lane
# A bar is a line-plot series of two points. Gradio's plot draws data that changes in place only while its series and
# colours stay the same (a new colour map redraws it, and the redraw can miss the new data), so the series are fixed
# slots: a lane, a logged line's place modulo TIMELINE_STEPS, a shade; every frame lists every slot.
TIMELINE_SLOTS = {f"{lane[0]}{i:02d}{'ab'[shade]}": (lane, LANE_COLORS[lane][shade])
                  for lane in LANE_COLORS for i in range(TIMELINE_STEPS) for shade in (0, 1)}
TIMELINE_COLORS = {name: color for name, (_, color) in TIMELINE_SLOTS.items()}


def timeline_rows(timeline: run_data.Timeline) -> list[list]:
    """A timeline as line-plot rows (TIMELINE_COLUMNS): each bar a segment from its start to its end on its lane's
    row, in its slot's colour, its hover text in `detail`; then a row without a time for each slot left empty. The
    shades alternate by batch (sampling) or step (training), so that bars that touch stay apart."""
    place = {bar.step: (timeline.left_out + i) % TIMELINE_STEPS
             for i, bar in enumerate(sorted((b for b in timeline.bars if b.lane == "training"), key=lambda b: b.step))}
    rows, used = [], set()
    for bar in timeline.bars:
        seconds = f"{bar.start:.2f}-{bar.end:.2f} s ({bar.end - bar.start:.2f} s)"
        behind = "" if bar.staleness is None else f", staleness {bar.staleness}"
        if bar.lane == "sampling":
            weights = "" if bar.staleness is None else f" from the weights after step {bar.step - 1 - bar.staleness}"
            detail = f"batch {bar.batch} sampled {seconds}{weights}; first trained at step {bar.step}"
        else:
            detail = f"step {bar.step} trained {seconds} on batch {bar.batch}{behind}"
        slot = f"{bar.lane[0]}{place[bar.step]:02d}{'ab'[(bar.batch if bar.lane == 'sampling' else bar.step) % 2]}"
        used.add(slot)
        rows += [[round(bar.start, 3), bar.lane, slot, detail], [round(bar.end, 3), bar.lane, slot, detail]]
    return rows + [[None, lane, slot, ""] for slot, (lane, _) in TIMELINE_SLOTS.items() if slot not in used]


def timeline_title(label: str, timeline: run_data.Timeline) -> str:
    """The timeline's label: the run, the steps drawn, and how much of the sampling ran while a step trained."""
    first, last = timeline.steps
    shown = f"steps {first}-{last}" + (f", the newest {last - first + 1}" if timeline.left_out else "") + (
        " since the resume" if timeline.restarted else "")
    sampling, overlap = timeline.sampling_seconds, timeline.overlap
    how = (f"sampling overlapped training {overlap:.2f} s of its {sampling:.2f} s ({overlap / sampling:.0%})"
           if overlap > 0 and sampling > 0 else "sampling and training alternate")
    return f"Timeline of {label}, {shown}: {how}"


def completions_table(rows: list[dict], limit: int = TABLE_ROWS) -> tuple[list[str], list[list]]:
    """(headers, rows) of the completions browser: the rewards per function appear when the run logs them."""
    funcs = list(dict.fromkeys(name for row in rows[:limit] for name in row["rewards"]))
    headers = ["step", "problem", "final answer", "gold", "reward", *funcs, "advantage", "temperature"]
    table = [[row["step"], row["problem"][:120], row["final"][:60], row["answer"][:40], row["reward"],
              *[row["rewards"].get(f) for f in funcs], row["advantage"], row["temperature"]] for row in rows[:limit]]
    return headers, table


def episode_messages(turns: list[dict], *, streaming: bool = False) -> list[dict]:
    """An agent's episode (docs/agents.md 6) as chat messages: each turn that called a tool and each tool result
    folded under its title, as written (a code block, so that a call's markup shows), then the last turn as an
    answer (`streaming`: still being written)."""
    messages = []
    for k, turn in enumerate(turns):
        text = str(turn.get("content", ""))
        if turn.get("role") == "assistant" and k == len(turns) - 1:
            messages += assistant_messages(text, streaming=streaming)
        else:
            title = "Tool result" if turn.get("role") == "tool" else "Tool call"
            messages.append({"role": "assistant", "content": f"```\n{text}\n```",
                             "metadata": {"title": title, "status": "done"}})
    return messages


def completion_detail(row: dict | None) -> tuple[list[dict], str]:
    """The chat messages of one completion (its reasoning folded, as in the chat) and a line of its numbers."""
    if row is None:
        return [], "Pick a row of the table."
    messages = [{"role": "user", "content": row["problem"]}, *episode_messages(row.get("turns"))] \
        if row.get("turns") else [{"role": "user", "content": row["problem"]}, *assistant_messages(row["completion"])]
    numbers = [f"step {row['step']}", f"gold answer {row['answer'] or '?'}",
               f"reward {row['reward']:g}" if row["reward"] is not None else "reward ?",
               *[f"{k} {v:g}" for k, v in row["rewards"].items() if v is not None],
               f"advantage {row['advantage']:+.3f}" if row["advantage"] is not None else "advantage ?",
               f"temperature {row['temperature']:.3g} ({row['temperature_of']})" if row["temperature"] is not None
               else "temperature ?"]
    return messages, " · ".join(numbers)


def shown_path(path: Path) -> str:
    """A folder as the page shows it: relative to the working directory when it lies inside it."""
    try:
        return str(path.relative_to(Path.cwd().resolve())) or "."
    except ValueError:
        return str(path)


def run_choices(roots: list[Path], initial: list[str]) -> list[str]:
    """The run folders the page offers: the ones it started with, then every run found under its folders."""
    choices = list(initial)
    for root in roots:
        for folder in run_data.find_runs(root) if root.is_dir() else []:
            if shown_path(folder) not in choices:
                choices.append(shown_path(folder))
    return choices


def bound(text, name: str) -> float | None:
    """A filter's bound typed in the page: None when empty; PageInputError when it is not a number."""
    text = "" if text is None else str(text).strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        raise PageInputError(f"{name}: '{text:.20}' is not a number; leave it empty for no bound") from None
    if value != value:  # NaN
        raise PageInputError(f"{name}: not a number; leave it empty for no bound")
    return value


def pick_completion(shown: list[dict], evt=None):
    """The completion of the clicked table row: (row, its chat messages, its numbers)."""
    index = evt.index[0] if evt is not None and isinstance(evt.index, (list, tuple)) else None
    row = shown[index] if index is not None and 0 <= index < len(shown or []) else None
    return (row, *completion_detail(row))
