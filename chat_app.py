"""A Gradio page to watch a run and read what its checkpoints say, next to their base model, while it trains.

    python chat_app.py                                          # runs/agrpo/final if it exists, else the embedded model
    python chat_app.py --model_name_or_path runs/agrpo/final    # base: the run's starting model (its config.yaml)
    python chat_app.py --model_name_or_path runs/lora/checkpoint-20 --base_model embedded --port 7861
    python chat_app.py --run runs/agrpo                         # the Run tab first: curves, warnings, completions
    python chat_app.py --run runs/grpo runs/dapo                # two runs overlaid (or a scripts/ablate.py output)

The Run tab (docs/watching.md) redraws the curves of metrics.jsonl as the run writes them (a plot per quantity, the
controllers' fields included; constant ones are listed, not drawn), by step or by generated tokens, several runs
overlaid, and a timeline per run of when each generation batch was sampled and each step trained; it shows the
warnings of lib/apps/health.py with their numbers and what to try, and browses completions.jsonl (filters by step,
reward and advantage sign; a row opens in the Chat tab with the nearest checkpoint).

The page listens on 127.0.0.1:7860 unless --host / --port (else Gradio's GRADIO_SERVER_NAME / GRADIO_SERVER_PORT)
say otherwise. Another host or `--share` (a public link) needs a login, `--auth USER:PASSWORD`
or $AGRPO_CHAT_AUTH, or `--no_auth_i_know`; folders typed in the page must lie inside the run folder, the model
folders it started with, the `--run` folders, or `--allow_dir` (docs/troubleshooting.md 3.3). In the Chat tab one
prompt goes to both models; their answers stream side by side, token by token, the reasoning apart from the final answer (the
`<think>` block, or everything before the last `Answer:` line). With a reference answer, each answer is scored by the
training reward functions. A run folder's `checkpoint-*` and `final/` are listed and switch the model in place; a PEFT
adapter loads on its base. Conversations save to and load from JSON, and the sampling settings export as a
`generation_config.json` that a model folder can use. Bad input (not a model folder, an adapter whose base is
missing, an empty prompt, a conversation longer than the model's context) is reported in the page.

With tools (`--tools`, else the run's own from its config.yaml; docs/agents.md 9.1) each answer is an episode, as in
training: the model's tool calls run in one tool worker for the page, their results go back as the chat template's
tool messages, and the model goes on; the chat shows each call and each result folded, then the answer.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from itertools import count
from functools import partial
from pathlib import Path

import torch
from transformers import GenerationConfig, TextIteratorStreamer
from transformers.utils import logging as hf_logging

from lib.checkpoint import list_checkpoints
from lib.data.records import DEFAULT_INSTRUCTION
from lib.apps import page
from lib.agents.episodes import Agent
from lib.agents.tools import ToolWorker, start_tools
from lib.apps import runs as run_data
from lib.models.folders import adapter_base, load_for_inference, model_folder_problem
from lib.models.embedded import EMBEDDED_ALIASES
from lib.models.modeling import end_token_ids, is_adapter_folder
from lib.rewards.open_r1 import REWARD_FUNCS
from lib.rewards.scoring import score_completions
from lib.models.reward_models import build_rewards, prompt_messages, reward_functions

DEFAULT_RUN = Path("runs/agrpo/final")
RUN_PLOTS = 30  # plot slots of the run view; a run logs fewer varying panels than this (docs/watching.md 2)
TIMELINES = 4  # timeline slots: one per run, for the first runs shown that log the timeline's keys
# a timeline's bars: its line plot's segments drawn thick, with square ends (Gradio's plots take no stroke width)
CSS = ".run-timeline .mark-line path { stroke-width: 14px; stroke-linecap: butt; }"


# ---------------------------------------------------------------------------------------------- the run view


def refresh_runs(selection, x_label, completions_run, last, *, roots):
    """The run view's curves, warnings and status for the selected runs; nothing (gr.skip) when no file changed."""
    import gradio as gr
    import pandas as pd

    folders, messages = page.selected_runs(selection, roots)
    signature = (tuple(selection or ()), x_label, run_data.signature(folders))
    if signature == last:
        return [gr.skip()] * (5 + RUN_PLOTS + TIMELINES)
    runs = [run_data.load_run(f, label) for f, label in zip(folders, page.run_labels(folders))]
    panels, constant = run_data.panels(runs, page.X_AXES.get(x_label, "step"))
    status = [*messages, *(run_data.status(r, page.shown_path(r.folder)) for r in runs)]
    if len(panels) > RUN_PLOTS:
        hidden = ", ".join(p.title for p in panels[RUN_PLOTS:])
        status.append(f"{len(panels) - RUN_PLOTS} more plots not shown: {hidden}")
    warnings = [w for w in map(page.warnings_markdown, runs) if w]
    plots = [gr.update(value=pd.DataFrame(p.rows, columns=["x", "y", "series"]), title=p.title, y_title=p.unit,
                       x_title=x_label, visible=True) for p in panels[:RUN_PLOTS]]
    plots += [gr.update(visible=False)] * (RUN_PLOTS - len(plots))
    timed = [(r, t) for r in runs if (t := run_data.timeline(r, page.TIMELINE_STEPS)) is not None]
    if len(timed) > TIMELINES:
        status.append(f"timelines of {len(timed) - TIMELINES} more runs not shown: "
                      f"{', '.join(r.label for r, _ in timed[TIMELINES:])}")
    timelines = []
    for r, timeline in timed[:TIMELINES]:  # the data only: a new title or colour map would redraw the plot
        timelines.append(gr.update(value=pd.DataFrame(page.timeline_rows(timeline), columns=page.TIMELINE_COLUMNS),
                                   label=page.timeline_title(r.label, timeline), visible=True))
    timelines += [gr.update(visible=False)] * (TIMELINES - len(timelines))
    choices = [page.shown_path(f) for f in folders]
    picked = completions_run if completions_run in choices else (choices[0] if choices else None)
    return [signature, "\n\n".join(status) or "Pick a run folder above, or start the page with --run FOLDER.",
            "\n\n".join(warnings) or ("No warnings (docs/watching.md 3 lists the checks)." if panels else ""),
            page.constants_markdown(constant), gr.update(choices=choices, value=picked), *plots, *timelines]


def refresh_table(run_shown, step_min, step_max, reward_min, reward_max, sign, last, *, roots):
    """The completions browser's rows for one run and the filters; nothing (gr.skip) when neither changed."""
    import gradio as gr
    import pandas as pd

    if not run_shown:
        return None, None, "Pick a run.", []
    try:
        folder = page.check_inside(str(run_shown), roots, "the run folder")
        limits = [page.bound(v, name) for v, name in ((step_min, "from step"), (step_max, "to step"),
                                                 (reward_min, "reward at least"), (reward_max, "reward at most"))]
    except page.PageInputError as error:
        return None, gr.skip(), str(error), gr.skip()
    kept_sign = sign if sign in run_data.SIGNS else "any"
    signature = (run_shown, *limits, kept_sign, run_data.signature([folder]))
    if signature == last:
        return [gr.skip()] * 4
    rows = run_data.completion_rows(run_data.load_run(folder), page.split_reasoning)
    kept = run_data.filter_completions(rows, *limits, kept_sign)
    headers, table = page.completions_table(kept)
    if not rows:
        note = f"no completions logged in {run_shown} yet (completions.jsonl, log_completions per step)"
    else:
        note = f"{len(kept)} of {len(rows)} logged completions match" + (
            f"; the newest {page.TABLE_ROWS} are shown" if len(kept) > page.TABLE_ROWS else "")
    return signature, pd.DataFrame(table, columns=headers), note, kept[:page.TABLE_ROWS]


def open_prompt(row, run_shown, *, roots):
    """Chat tab outputs for a completion: the tab, its problem as the prompt, its gold answer as the reference, the
    run folder and its checkpoint nearest the policy that sampled it (lib/apps/runs.nearest_checkpoint), a status line."""
    import gradio as gr

    if row is None or not run_shown:
        return gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip(), "Pick a completion in the table first."
    try:
        folder = page.check_inside(str(run_shown), roots, "the run folder")
    except page.PageInputError as error:
        return gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip(), str(error)
    name = run_data.nearest_checkpoint(run_data.load_run(folder), row["step"])
    message = (f"step {row['step']}'s prompt; loading {name}, the nearest checkpoint..." if name else
               f"step {row['step']}'s prompt; {run_shown} has no checkpoint yet, so the loaded models answer it")
    return (gr.Tabs(selected="chat"), row["problem"], row["answer"], page.shown_path(folder),
            gr.update(choices=page.checkpoint_choices(str(folder)), value=name), message)


@dataclass
class OpenInChat:
    """What the chat tab wires to the run view: the button, the picked row and the completions' run folder."""

    button: object
    row: object
    run: object


def build_run_view(gr, roots: list[Path], watched: list[str], refresh_seconds: float) -> OpenInChat:
    """The Run tab: the runs to watch, their warnings and curves, and the completions browser (docs/watching.md)."""
    with gr.Row():
        selection = gr.Dropdown(choices=page.run_choices(roots, watched), value=watched, multiselect=True,
                                allow_custom_value=True, scale=5, elem_id="run-select",
                                label="Runs: run folders, or a folder of runs (a scripts/ablate.py output)")
        x_axis = gr.Radio(list(page.X_AXES), value="step", label="x axis", elem_id="run-x", scale=2)
        with gr.Column(scale=1, min_width=120):
            live = gr.Checkbox(value=True, label=f"live (every {refresh_seconds:g} s)", elem_id="run-live")
            rescan = gr.Button("Rescan folders", size="sm")
    run_status = gr.Markdown("Loading the run...", elem_id="run-status")
    run_warnings = gr.Markdown(elem_id="run-warnings")
    with gr.Row():  # two plots a line on a wide screen; a hidden slot takes no room
        plots = [gr.LinePlot(x="x", y="y", color="series", visible=False, height=260, min_width=480,
                             elem_id=f"run-plot-{i}") for i in range(RUN_PLOTS)]
    # per run: when each generation batch was sampled and each step trained (lib/apps/runs.timeline)
    timelines = [gr.LinePlot(x="seconds", y="lane", color="slot", visible=False, height=200, tooltip=["detail"],
                             color_map=page.TIMELINE_COLORS, colors_in_legend=[], x_title="seconds since start",
                             y_title=" ", show_label=True, elem_id=f"run-timeline-{i}", elem_classes=["run-timeline"])
                 for i in range(TIMELINES)]
    constants = gr.Markdown(elem_id="run-constants")
    gr.Markdown("### Completions (completions.jsonl)")
    with gr.Row():
        completions_run = gr.Dropdown(choices=[], label="Run", scale=3, elem_id="completions-run")
        bounds = [gr.Textbox(label=label, placeholder="any", elem_id=f"filter-{name}", min_width=90)
                  for name, label in (("step-min", "from step"), ("step-max", "to step"),
                                      ("reward-min", "reward at least"), ("reward-max", "reward at most"))]
        step_min, step_max, reward_min, reward_max = bounds
        sign = gr.Radio(list(run_data.SIGNS), value="any", label="advantage", elem_id="filter-sign", scale=2)
    table_note = gr.Markdown(elem_id="completions-note")
    table = gr.Dataframe(interactive=False, wrap=True, max_height=420, elem_id="completions")
    with gr.Row():
        detail = gr.Chatbot(height=320, label="completion (reasoning folded)", elem_id="completion-detail", scale=3)
        with gr.Column(scale=2):
            detail_info = gr.Markdown("Pick a row of the table.", elem_id="completion-info")
            open_button = gr.Button("Open this prompt in the chat, with the nearest checkpoint",
                                    elem_id="open-in-chat")
    curves_seen, table_seen, shown, row = gr.State(None), gr.State(None), gr.State([]), gr.State(None)
    timer = gr.Timer(refresh_seconds)

    run_inputs = [selection, x_axis, completions_run, curves_seen]
    run_outputs = [curves_seen, run_status, run_warnings, constants, completions_run, *plots, *timelines]
    table_inputs = [completions_run, step_min, step_max, reward_min, reward_max, sign, table_seen]
    table_outputs = [table_seen, table, table_note, shown]
    gr.on([timer.tick, selection.change, x_axis.change], partial(refresh_runs, roots=roots), run_inputs,
          run_outputs, show_progress="hidden", api_name="run_curves")
    gr.on([timer.tick, completions_run.change, step_min.submit, step_max.submit, reward_min.submit,
           reward_max.submit, step_min.blur, step_max.blur, reward_min.blur, reward_max.blur, sign.change],
          partial(refresh_table, roots=roots), table_inputs, table_outputs, show_progress="hidden",
          api_name="run_completions")
    def pick(rows, evt):
        return page.pick_completion(rows, evt)

    pick.__annotations__ = {"evt": gr.SelectData}  # the class itself: gradio finds the event by it (lazy import)
    table.select(pick, [shown], [row, detail, detail_info], api_name=False)
    live.change(lambda on: gr.Timer(active=on), live, timer, api_name=False)
    rescan.click(lambda chosen: (gr.update(choices=page.run_choices(roots, list(chosen or []))), None), selection,
                 [selection, curves_seen], api_name=False)
    return OpenInChat(open_button, row, completions_run)


# ---------------------------------------------------------------------------------------------- the models


class Slot:
    """One side of the page: a loaded model and its tokenizer, swapped in place under a lock."""

    def __init__(self, label: str):
        self.label = label
        self.name: str | None = None
        self.model = None
        self.tokenizer = None
        self.lock = threading.Lock()

    def load(self, name: str) -> str:
        """Load `name` (errors as a message that names the fix; the previous model stays loaded)."""
        problem = model_folder_problem(name)
        if problem:
            return f"{self.label}: {problem}"
        try:
            model, tokenizer = load_for_inference(name)
        except (OSError, ValueError) as error:  # a folder whose files transformers / peft cannot read
            return f"{self.label}: could not load '{name}' ({type(error).__name__}: {error})"
        with self.lock:
            self.name, self.model, self.tokenizer = name, model, tokenizer
        return f"{self.label}: loaded {name}"

    def context_length(self) -> int:
        config = getattr(self.model, "get_base_model", lambda: self.model)().config
        return int(getattr(config, "max_position_embeddings", 2048))

    def prompt_ids(self, messages: list[dict], config: GenerationConfig, template_kwargs: dict | None = None):
        """The conversation's token ids, the generation prompt opened (`template_kwargs`: the chat template's
        variables, such as `tools`). Raises ValueError if it and max new tokens do not fit the model's context."""
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=True, **(template_kwargs or {}))["input_ids"]
        length, limit = len(ids), self.context_length()
        if length + config.max_new_tokens > limit:
            raise ValueError(f"{self.label}: the conversation is {length} tokens and max new tokens is "
                             f"{config.max_new_tokens}, more than the model's context of {limit}; clear the chat, "
                             f"shorten the prompt or lower max new tokens")
        return list(ids)

    def sample(self, ids: list[int], config: GenerationConfig, seed: int, max_new_tokens: int | None = None):
        """One model turn from the token ids `ids`, generated in a thread: a generator that yields its text as it
        comes (token by token) and returns its new token ids (lib/agents/episodes.Agent.chat's `sample`). The page
        decodes with the model's own `generate`, not the trainer's and the evaluator's sampler
        (lib/sampling/engines.make_sampler): that one samples whole batches, and a page streams one answer."""
        streamer = TextIteratorStreamer(self.tokenizer, skip_prompt=True, skip_special_tokens=True, timeout=600)
        out = {}

        def work():
            try:
                with self.lock, torch.no_grad():
                    torch.manual_seed(seed)
                    tensor = torch.tensor([ids], device=self.model.device)
                    turn_config = copy.deepcopy(config)
                    turn_config.max_new_tokens = max_new_tokens or config.max_new_tokens
                    out["ids"] = self.model.generate(input_ids=tensor, attention_mask=torch.ones_like(tensor),
                                                     generation_config=turn_config, streamer=streamer)
            except Exception as error:  # noqa: BLE001 - raised again in the page's thread, which reports it
                out["error"] = error
                streamer.end()

        thread = threading.Thread(target=work, daemon=True)
        thread.start()
        yield from streamer
        thread.join()
        if "error" in out:
            raise out["error"]
        return out["ids"][0, len(ids):].tolist()


@dataclass
class PageTools:
    """The page's tools (docs/agents.md 9.1): their specs and schemas, the one worker that runs their calls for the
    whole page (started once, closed when the page stops), and the episode limit."""

    specs: list[str]
    schemas: list[dict]
    worker: ToolWorker
    max_iterations: int | None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def call(self, name: str, arguments: dict) -> tuple[str, bool]:
        with self.lock:  # one call at a time: the worker answers one request at a time
            return self.worker.call(name, arguments)

    def agent(self, tokenizer, max_new_tokens: int) -> Agent:
        """An answer's agent: the training rules (the call format, the results' rendering, the limits), the page's
        max new tokens as the episode's budget, the turns and the results together (max_completion_length's
        rule)."""
        return Agent(tokenizer, self.call, self.max_iterations, max_new_tokens, self.schemas)

    def line(self) -> str:
        names = ", ".join(s["function"]["name"] for s in self.schemas)
        limit = "no limit" if self.max_iterations is None else f"at most {self.max_iterations}"
        return f"tools: {names} (turns with calls: {limit}; tool_timeout {self.worker.timeout:g} s)"

    def close(self) -> None:
        self.worker.close()


def page_tools(args: argparse.Namespace, settings: dict) -> PageTools | None:
    """The page's tools: `--tools` (given alone: none), else the `tools` of the run's config.yaml; their limits from
    --max_tool_calling_iterations / --tool_timeout, else the run's, else no limit and 10 s. Each tool is imported and
    described here, before any model loads; SystemExit naming the option (or config.yaml) and the fix. The worker
    is made, not started."""
    from_run = args.tools is None
    specs = (settings.get("tools") or []) if from_run else args.tools
    if not specs:
        return None
    where = "the run's config.yaml 'tools'" if from_run else "--tools"
    fix = ("; pass --tools with tools that load here, or --tools alone to chat without tools" if from_run else
           "; give each as module:function or file.py:function, a typed function with a Google-style docstring")
    limit = args.max_tool_calling_iterations
    if limit is None:
        limit = settings.get("max_tool_calling_iterations")
    elif limit < 0:
        raise SystemExit(f"error: --max_tool_calling_iterations must be >= 0, got {limit} (leave it out for no limit)")
    timeout = args.tool_timeout if args.tool_timeout is not None else settings.get("tool_timeout", 10.0)
    if not (isinstance(timeout, (int, float)) and timeout >= 0):  # also NaN
        raise SystemExit(f"error: --tool_timeout must be >= 0 seconds (0: no limit), got {timeout}")
    try:  # checked, the worker made (lib/agents/tools.start_tools, as the trainer and the evaluator build theirs)
        specs, schemas, worker = start_tools(specs, float(timeout), start=False)
    except ValueError as error:
        raise SystemExit(f"error: {where}: {error}{fix}") from None
    return PageTools(specs, schemas, worker, limit)


# ---------------------------------------------------------------------------------------------- the page


def build_app(checkpoint: Slot, base: Slot, args: argparse.Namespace, run_dir: Path | None, settings: dict,
              roots: list[Path] | None = None, started: set[str] | None = None, watched: list[str] | None = None,
              refresh_seconds: float = 2.0, tools: PageTools | None = None):
    """The page: a Chat tab and a Run tab. `roots`: the folders whose models it may list and load and whose runs it
    may show (default: the run folder); `started`: the names it was started with, which it may load again (hub ids
    included); `watched`: the run folders the Run tab shows first; `refresh_seconds`: how often it looks for new
    lines; `tools`: the tools each answer may call (an answer is then an episode, docs/agents.md 9.1)."""
    import gradio as gr

    roots = roots if roots is not None else ([run_dir.resolve()] if run_dir else [])
    started = started or {name for name in (checkpoint.name, base.name) if name}
    # the files the Save and Export buttons hand to the browser: one folder for the page, made at the first click and
    # removed when the page's process ends (a folder of /tmp each click outlived it); a click gets a sub-folder of its
    # own, so that its file keeps its name
    downloads = None

    def download_folder() -> Path:
        nonlocal downloads
        downloads = downloads or tempfile.TemporaryDirectory(prefix="agrpo-chat-")
        return Path(tempfile.mkdtemp(dir=downloads.name))

    # the trainer's and the evaluator's rewards, from the same builder: the functions, and a reward model (a folder or
    # hub id in --reward_funcs) loaded onto the CPU, as the page's models (lib/models/reward_models.build_rewards);
    # the built-ins' options as the run trained with them (cosine's length, the overlong buffer, the repetition's n)
    try:
        reward_funcs = build_rewards(args, "cpu", batch_size=2, options=page.reward_options_of(settings))
    except ValueError as error:
        raise SystemExit(f"error: --reward_funcs: {error}") from None

    def score(text: str, ids: list[int], length: int, reference: str, prompt: str, instruction: str,
              system_prompt: str) -> dict | None:
        """Every reward of `text` against the reference answer, with the columns the trainer gives: the answer's
        token ids and its length in the model's tokens (cosine and soft_overlong count tokens). A reward model reads
        the turn's prompt as the policy got it (the instruction after the problem, the system prompt), in its own chat
        template, and the answer."""
        if not reference.strip():
            return None
        record = {"prompt": prompt_messages(prompt, instruction or "", system_prompt or None)}
        per_func, _ = score_completions(reward_funcs, [""], [text], {"answer": [reference.strip()],
                                                                     "completion_length": [length]},
                                        completion_ids=[ids], records=[record])
        return {name: values[0] for (name, _), values in zip(reward_funcs, per_func)}

    def answer(slot: Slot, side: str, turns, prompt, instruction, system_prompt, greedy, temperature, top_p,
               max_new_tokens):
        """One side's answer, as a generator: without tools, the text of one model turn as it comes, returning its
        token ids; with tools, an episode (lib/agents/episodes.Agent.chat: the text as it comes, then each finished
        message), returning the Episode. The settings and the conversation's length are checked here (ValueError,
        TypeError) before anything is generated."""
        config = page.generation_config(greedy, temperature, top_p, max_new_tokens,
                                        end_token_ids(slot.model, slot.tokenizer), slot.tokenizer.pad_token_id)
        agent = tools.agent(slot.tokenizer, config.max_new_tokens) if tools is not None else None
        # the tools' description as in training: the template's own `tools`, else the plain format's system text
        system, template_kwargs = (agent.prompt_settings(system_prompt or None, None) if agent is not None
                                   else (system_prompt or None, None))
        ids = slot.prompt_ids(page.model_messages(turns, side, prompt, instruction, system), config, template_kwargs)
        if agent is None:
            return slot.sample(ids, config, args.seed)
        seeds = count(args.seed)  # each turn of the episode its own seed, the first the page's

        def sample(context: list[int], room: int):
            return slot.sample(context, config, next(seeds), room)
        return agent.chat(sample, ids)

    def send(prompt, reference, instruction, system_prompt, greedy, temperature, top_p, max_new_tokens, turns):
        turns = list(turns or [])
        if not prompt or not prompt.strip():
            yield page.chat_view(turns, "checkpoint"), page.chat_view(turns, "base"), "", "", \
                "Type a prompt first: the prompt is empty.", turns
            return
        sides = [s for s in (("checkpoint", checkpoint), ("base", base)) if s[1].model is not None]
        try:
            answers = {side: answer(slot, side, turns, prompt.strip(), instruction, system_prompt, greedy,
                                    temperature, top_p, max_new_tokens) for side, slot in sides}
        except (TypeError, ValueError) as error:  # TypeError: a setting sent as null through the API
            yield page.chat_view(turns, "checkpoint"), page.chat_view(turns, "base"), "", "", str(error), turns
            return
        turn = {"prompt": prompt.strip(), "reference": reference.strip(), "streaming": True,
                **{side: "" for side in answers}}
        turns.append(turn)
        start = time.perf_counter()
        pending, writing = dict(answers), set()  # writing: the sides whose last episode message is still growing
        tokens = {}  # each side's answer: (its token ids, how many of them the model sampled)
        while pending:
            for side, stream in list(pending.items()):
                try:
                    event = next(stream)
                except StopIteration as end:  # the answer's end: the episode, or the turn's token ids
                    del pending[side]
                    # the trainer's completion_length counts the model's tokens, not a tool result's
                    tokens[side] = (end.value, len(end.value)) if tools is None else (end.value.ids,
                                                                                      sum(end.value.model))
                    if tools is not None:  # the episode's text as the rewards get it in training
                        turn[side] = dict(sides)[side].tokenizer.decode(end.value.ids, skip_special_tokens=True)
                        turn[page.episode_key(side)] = end.value.messages
                    continue
                if tools is None:
                    turn[side] += event
                    continue
                episode = turn.setdefault(page.episode_key(side), [])
                if isinstance(event, str):  # the model's next piece of text
                    if side not in writing:
                        episode.append({"role": "assistant", "content": ""})
                        writing.add(side)
                    episode[-1]["content"] += event
                elif event["role"] == "assistant":  # the turn, finished
                    episode[-1 if side in writing else len(episode):] = [event]
                    writing.discard(side)
                else:  # a tool's result
                    episode.append(event)
            yield page.chat_view(turns, "checkpoint"), page.chat_view(turns, "base"), "", "", "generating...", turns
        turn["streaming"] = False
        turn["seconds"] = round(time.perf_counter() - start, 2)
        turn["tokens"] = {side: tokens[side][1] for side in answers}  # the model's tokens, as completion_length
        turn["rewards"] = {side: score(turn[side], *tokens[side], turn["reference"], turn["prompt"], instruction,
                                       system_prompt) for side in answers}
        yield (page.chat_view(turns, "checkpoint"), page.chat_view(turns, "base"),
               page.reward_line(turn["rewards"].get("checkpoint")), page.reward_line(turn["rewards"].get("base")),
               f"answered in {turn['seconds']:.1f} s", turns)

    def switch(run_folder, choice, base_name):
        """Load a checkpoint of the run folder (or any model folder inside the allowed folders) and the base."""
        messages = []
        try:
            if choice:
                target = choice
                if run_folder and run_folder.strip():
                    folder = page.check_inside(run_folder.strip(), roots, "the run folder")
                    if choice in page.checkpoint_choices(str(folder)):
                        target = str(folder / choice)
                messages.append(checkpoint.load(page.loadable(target, roots, started)))
            if base_name and base_name != base.name:
                messages.append(base.load(page.loadable(base_name, roots, started)))
        except page.PageInputError as error:
            messages.append(str(error))
        return " · ".join(messages) or "nothing to load", title()

    def refresh(run_folder):
        try:
            folder = page.check_inside(run_folder or "", roots, "the run folder") if run_folder else None
        except page.PageInputError as error:
            return gr.update(choices=[], value=None), str(error)
        if folder is None or not folder.is_dir():
            return gr.update(choices=[], value=None), f"'{run_folder}' is not a folder; give a run's output_dir"
        choices = page.checkpoint_choices(str(folder))
        if not choices:
            return gr.update(choices=[], value=None), f"no final/ or checkpoint-* in '{run_folder}' yet"
        return gr.update(choices=choices, value=choices[0]), f"{len(choices)} model folder(s) in {run_folder}"

    def clear():
        return [], [], "", "", "cleared", []

    def save(turns, instruction, system_prompt, greedy, temperature, top_p, max_new_tokens):
        data = {"format": page.CONVERSATION_FORMAT, "checkpoint": checkpoint.name, "base": base.name,
                "instruction": instruction, "system_prompt": system_prompt,
                "settings": {"greedy": greedy, "temperature": temperature, "top_p": top_p,
                             "max_new_tokens": max_new_tokens},
                "turns": [{k: v for k, v in t.items() if k != "streaming"} for t in turns or []]}
        path = download_folder() / "conversation.json"
        path.write_text(json.dumps(data, indent=2))
        return str(path), f"saved {len(data['turns'])} turn(s)"

    def load(file, turns):
        keep = (page.chat_view(turns or [], "checkpoint"), page.chat_view(turns or [], "base"))
        if file is None:
            return (*keep, gr.update(), gr.update(), gr.update(), gr.update(), gr.update(),
                    "choose a conversation .json file first", turns)
        try:
            data = page.read_conversation(file)
        except (OSError, page.PageInputError) as error:
            reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
            return (*keep, gr.update(), gr.update(), gr.update(), gr.update(), gr.update(),
                    f"could not load the conversation: {reason}", turns)
        loaded, s = data["turns"], data["settings"]
        return (page.chat_view(loaded, "checkpoint"), page.chat_view(loaded, "base"), s["greedy"], s["temperature"],
                s["top_p"], s["max_new_tokens"], data["instruction"], f"loaded {len(loaded)} turn(s)", loaded)

    def export(greedy, temperature, top_p, max_new_tokens):
        slot = checkpoint if checkpoint.model is not None else base
        try:
            config = page.generation_config(greedy, temperature, top_p, max_new_tokens,
                                       end_token_ids(slot.model, slot.tokenizer), slot.tokenizer.pad_token_id)
        except (TypeError, ValueError) as error:
            return None, f"these settings do not make a valid generation config: {error}"
        folder = download_folder()
        config.save_pretrained(folder)
        return str(folder / "generation_config.json"), "generation_config.json: put it in the model folder"

    def title() -> str:
        heading = f"### {checkpoint.name or '(no checkpoint)'}  vs  base {base.name or '(none)'}"
        return heading if tools is None else f"{heading}\n\n{tools.line()}"

    with gr.Blocks(title="agrpo chat") as app:
        with gr.Tabs(selected="run" if getattr(args, "run", None) else "chat") as tabs:
            with gr.Tab("Chat", id="chat"):
                heading = gr.Markdown(title())
                with gr.Row():
                    with gr.Column():
                        gr.Markdown("**checkpoint**")
                        chat_a = gr.Chatbot(height=420, label="checkpoint", elem_id="chat-checkpoint")
                        reward_a = gr.Markdown(elem_id="reward-checkpoint")
                    with gr.Column():
                        gr.Markdown("**base**")
                        chat_b = gr.Chatbot(height=420, label="base", elem_id="chat-base")
                        reward_b = gr.Markdown(elem_id="reward-base")
                with gr.Row():
                    prompt = gr.Textbox(label="Prompt", placeholder="Ask both models...", scale=4, elem_id="prompt")
                    reference = gr.Textbox(label="Reference answer (optional: scores both answers)", scale=1,
                                           elem_id="reference")
                with gr.Row():
                    send_button = gr.Button("Send", variant="primary", elem_id="send")
                    clear_button = gr.Button("Clear")
                status = gr.Markdown(elem_id="status")
                turns = gr.State([])
                with gr.Accordion("Sampling", open=False):
                    with gr.Row():
                        greedy = gr.Checkbox(value=True, label="greedy")
                        temperature = gr.Slider(0.05, 2.0, value=0.7, step=0.05, label="temperature")
                        top_p = gr.Slider(0.05, 1.0, value=1.0, step=0.05, label="top_p")
                        max_new_tokens = gr.Slider(8, 2048, value=args.max_new_tokens, step=8, label="max new tokens")
                    instruction = gr.Textbox(value=settings.get("instruction", DEFAULT_INSTRUCTION),
                                             label="Instruction appended to each prompt (as in training)")
                    system_prompt = gr.Textbox(value=settings.get("system_prompt") or "", label="System prompt")
                    with gr.Row():
                        export_button = gr.Button("Export generation_config.json")
                        export_file = gr.File(label="generation_config.json")
                with gr.Accordion("Checkpoint", open=False):
                    with gr.Row():
                        run_box = gr.Textbox(value=str(run_dir) if run_dir else "", label="Run folder (output_dir)")
                        choices = page.checkpoint_choices(str(run_dir)) if run_dir else []
                        picker = gr.Dropdown(choices=choices, value=choices[0] if choices else None,
                                             allow_custom_value=True, label="Checkpoint (or any model folder)",
                                             elem_id="picker")
                        base_box = gr.Textbox(value=base.name or "", label="Base model")
                    with gr.Row():
                        refresh_button = gr.Button("List checkpoints")
                        load_button = gr.Button("Load")
                with gr.Accordion("Conversation", open=False), gr.Row():
                    save_button = gr.Button("Save conversation")
                    saved_file = gr.File(label="conversation.json")
                    upload = gr.File(label="Load a conversation (.json)", file_types=[".json"])
                    load_conv_button = gr.Button("Load conversation")

            with gr.Tab("Run", id="run"):
                open_in_chat = build_run_view(gr, roots, watched or [], refresh_seconds)
        sampling = [greedy, temperature, top_p, max_new_tokens]
        outputs = [chat_a, chat_b, reward_a, reward_b, status, turns]
        inputs = [prompt, reference, instruction, system_prompt, *sampling, turns]
        send_button.click(send, inputs, outputs, api_name="send")
        prompt.submit(send, inputs, outputs, api_name=False)
        clear_button.click(clear, None, outputs, api_name="clear")
        refresh_button.click(refresh, [run_box], [picker, status], api_name="list_checkpoints")
        load_button.click(switch, [run_box, picker, base_box], [status, heading], api_name="load_checkpoint")
        export_button.click(export, sampling, [export_file, status], api_name="export_generation_config")
        save_button.click(save, [turns, instruction, system_prompt, *sampling], [saved_file, status],
                          api_name="save_conversation")
        load_conv_button.click(load, [upload, turns], [chat_a, chat_b, *sampling, instruction, status, turns],
                               api_name="load_conversation")
        # a row of the run view's completions browser: its prompt in the chat, with the nearest checkpoint loaded
        open_in_chat.button.click(partial(open_prompt, roots=roots), [open_in_chat.row, open_in_chat.run],
                                  [tabs, prompt, reference, run_box, picker, status], api_name="open_in_chat").then(
            lambda *a: switch(*a) if a[1] else (gr.skip(), gr.skip()), [run_box, picker, base_box], [status, heading],
            api_name=False)
    return app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_name_or_path", default=None,
                        help=f"Checkpoint to talk to (default: {DEFAULT_RUN} if it exists, else the embedded model).")
    parser.add_argument("--base_model", default=None,
                        help="Model to show beside it (default: an adapter's base, or the run's starting model).")
    parser.add_argument("--reward_funcs", nargs="+", default=["accuracy", "format"],
                        help=f"Rewards scored against the reference answer, as the trainer's reward_funcs: built-in "
                             f"names ({', '.join(REWARD_FUNCS)}), module:function or file.py:function, or a reward "
                             f"model's folder or hub id (a sequence-classification model, loaded on the CPU). "
                             f"cosine, soft_overlong and repetition take the options the run trained with (its "
                             f"config.yaml), else the trainer's defaults.")
    parser.add_argument("--max_new_tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0, help="Sampling seed, the same for both sides.")
    parser.add_argument("--host", default=None, help="Address to listen on (default: $GRADIO_SERVER_NAME, else "
                        "127.0.0.1: this machine only).")
    parser.add_argument("--port", type=int, default=None, help="Port (default: $GRADIO_SERVER_PORT, else 7860).")
    parser.add_argument("--share", action="store_true", help="Ask Gradio for a public share link (off by default).")
    parser.add_argument("--auth", default=None, metavar="USER:PASSWORD",
                        help=f"Require this login (also from ${page.AUTH_ENV}, which keeps it off the command line). "
                             f"Needed with --share or a --host other than this machine, unless --no_auth_i_know.")
    parser.add_argument("--no_auth_i_know", action="store_true",
                        help="Serve --share or another --host without a login: anyone who reaches the page can load "
                             "and run the model folders it may open.")
    parser.add_argument("--allow_dir", nargs="+", default=None, metavar="FOLDER",
                        help="More folders whose models the page may list and load (default: only the run folder and "
                             "the model folders it starts with).")
    parser.add_argument("--run", nargs="+", default=None, metavar="FOLDER",
                        help="Run folders to watch in the Run tab, which opens first: curves, warnings, completions "
                             "(a folder of runs, such as a scripts/ablate.py output, stands for all of them). The chat "
                             "loads the first run's final/ or newest checkpoint, if it has one yet.")
    parser.add_argument("--refresh", type=float, default=2.0, metavar="SECONDS",
                        help="How often the Run tab looks for new lines while 'live' is ticked.")
    parser.add_argument("--tools", nargs="*", default=None, metavar="SPEC",
                        help="Tools the models may call, as module:function or file.py:function (as the trainer's "
                             "--tools): each answer is then an episode, its calls and results shown in the chat "
                             "(docs/agents.md 9.1). Default: the tools of the run's config.yaml; --tools alone: none.")
    parser.add_argument("--max_tool_calling_iterations", type=int, default=None,
                        help="Model turns with tool calls an answer may have (default: the run's, else no limit).")
    parser.add_argument("--tool_timeout", type=float, default=None,
                        help="Seconds one tool call may take, 0: no limit (default: the run's, else 10).")
    args = parser.parse_args(argv)
    listen_address(args, os.environ)
    return args


def listen_address(args: argparse.Namespace, environ) -> None:
    """args.host and args.port as Gradio's own launch reads them: the flag, else GRADIO_SERVER_NAME /
    GRADIO_SERVER_PORT, else 127.0.0.1:7860. args.host_source names where the host came from, for the login rule's
    message (`page.exposure` applies it to a host from the environment as to a flag)."""
    args.host_source = "--host"
    if args.host is None and environ.get("GRADIO_SERVER_NAME", "").strip():
        args.host, args.host_source = environ["GRADIO_SERVER_NAME"].strip(), "GRADIO_SERVER_NAME"
    args.host = args.host or "127.0.0.1"
    if args.port is None and environ.get("GRADIO_SERVER_PORT", "").strip():
        text = environ["GRADIO_SERVER_PORT"].strip()
        if not text.isdigit() or not 0 < int(text) < 65536:
            raise SystemExit(f"error: GRADIO_SERVER_PORT: {text!r} is not a port number (1-65535); set it to one, "
                             f"unset it, or pass --port")
        args.port = int(text)
    args.port = 7860 if args.port is None else args.port


def run_model(folder: Path) -> str | None:
    """The model folder of a run to chat with: final/, else its newest checkpoint, else None (none written yet)."""
    if (folder / "final").is_dir():
        return str(folder / "final")
    latest = list_checkpoints(folder)
    return str(latest[-1]) if latest else None


def resolve_models(args: argparse.Namespace) -> tuple[str | None, str | None, Path | None, dict]:
    """(checkpoint, base, run folder, run settings); raises SystemExit with the fix for a bad argument. With --run and
    no --model_name_or_path, the checkpoint is the first run's model folder, or None while it has none."""
    watched = []
    if getattr(args, "run", None):
        watched = run_data.find_runs(args.run[0]) or [Path(args.run[0]).expanduser()]
    if args.model_name_or_path or not watched:
        name = args.model_name_or_path or (str(DEFAULT_RUN) if DEFAULT_RUN.is_dir() else "embedded")
        problem = model_folder_problem(name)
        if problem:
            raise SystemExit(f"error: --model_name_or_path: {problem}")
        run_dir = page.run_folder_of(name) if name not in EMBEDDED_ALIASES else None
    else:
        name, run_dir = run_model(watched[0]), watched[0]
    settings = page.run_settings(run_dir)
    base = args.base_model
    if base is None:
        path = Path(name).expanduser() if name else None
        if path is not None and path.is_dir() and is_adapter_folder(str(path)):
            base = adapter_base(str(path))
        else:
            base = settings.get("model_name_or_path") or ("embedded" if name in EMBEDDED_ALIASES or name is None
                                                          else None)
        base = "embedded" if base in EMBEDDED_ALIASES else base
    if base is not None and model_folder_problem(base):
        raise SystemExit(f"error: --base_model: {model_folder_problem(base)}")
    return name, base, run_dir, settings


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    auth = page.exposure(args)  # before anything loads
    for folder in args.allow_dir or []:
        if not Path(folder).expanduser().is_dir():
            raise SystemExit(f"error: --allow_dir: '{folder}' is not a folder")
    if args.max_new_tokens < 1:
        raise SystemExit(f"error: --max_new_tokens must be >= 1, got {args.max_new_tokens}")
    if not args.refresh >= 0.5:  # also NaN
        raise SystemExit(f"error: --refresh must be at least 0.5 seconds, got {args.refresh}")
    try:  # as the trainer and the evaluator check them: names, functions and reward models, before any model loads
        reward_functions(args.reward_funcs)
    except ValueError as error:
        raise SystemExit(f"error: --reward_funcs: {error}") from None
    if args.tools is not None:  # --tools checked before the model arguments are looked at
        page_tools(args, {})
    name, base_name, run_dir, settings = resolve_models(args)
    tools = page_tools(args, settings)  # the tools imported and described before any model loads
    hf_logging.disable_progress_bar()
    checkpoint, base = Slot("checkpoint"), Slot("base")
    for slot, target in ((checkpoint, name), (base, base_name)):
        if target is not None:
            message = slot.load(target)
            if slot.model is None:
                raise SystemExit(f"error: {message}")
    watched = args.run or [page.shown_path(run_dir.resolve()) if run_dir else str(DEFAULT_RUN.parent)]
    roots = page.allowed_roots(args, name, base_name, run_dir, watched)
    started = {n for n in (name, base_name) if n}
    if args.host not in page.LOCAL_HOSTS or args.share:
        login = f"login required (user '{auth[0]}')" if auth else "NO login (--no_auth_i_know)"
        print(f"The page is reachable from other machines ({'a public --share link' if args.share else args.host}), "
              f"{login}. Whoever reaches it can: chat with {name} and {base_name or '(no base)'}; list and load "
              f"(and so run) any model folder inside {', '.join(map(str, roots)) or '(none)'}; save and load "
              f"conversations{'; make the models call ' + tools.line() if tools is not None else ''}.", flush=True)
    try:
        if tools is not None:
            tools.worker.start()  # one worker for the page: it imports the tools while the page starts
            print(f"Answers are episodes with {tools.line()}", flush=True)
            if settings.get("environment_factory"):
                print("The run's environment_factory is not made here: answers get the run's plain tools only "
                      "(docs/agents.md 9.1).", flush=True)
        app = build_app(checkpoint, base, args, run_dir, settings, roots, started, watched, args.refresh, tools)
        # a stop from a service manager or `kill` (SIGTERM) closes the page as Ctrl-C does: the server closed, the
        # tools' worker stopped (below), the folder of its downloads removed (Python's exit)
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        app.queue().launch(server_name=args.host, server_port=args.port, share=args.share, show_error=True,
                           auth=auth, max_file_size=page.MAX_UPLOAD_BYTES, css=CSS)
    finally:
        if tools is not None:
            tools.close()


if __name__ == "__main__":
    sys.exit(main())
