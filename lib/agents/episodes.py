"""Agents: tool calls inside a rollout (docs/agents.md).

An episode is a completion of several turns: the model writes, its tool calls are run (lib/agents/tools.py), their
results are appended to the completion as the chat template renders a `tool` message, and the model goes on, until
a turn calls no tool, `max_tool_calling_iterations` turns have called one, or the completion budget is spent. The
tokens of the results are part of the completion (later turns read them: `Rollout.sequence_mask`) but not the
model's (`Rollout.completion_mask` is 0 there), so the trainer trains, regularises and counts only the model's.
`run_episodes` works over any sampler with the trainer's `generate` (the HF sampler and vLLM's).

Environments (`environment_factory`, as TRL 1.16's GRPOTrainer takes it; docs/agents.md 7): a class, or a mapping of
names to classes picked per data-set row by its `environment` column. Each episode has its own instance, made in the
tool worker (the state lives where the methods run) before the episode's first turn: its `reset(**row)` gets the
data-set row, and the text it returns is appended to the prompt's last user message, before the chat template. Its
public methods are the episode's tools, beside the run's `tools`; its `get_reward()`, read when the episodes end, is
a reward function of its own (named after the class, weight 1), and the instance is then dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch
from torch.nn.utils.rnn import pad_sequence

from lib.config import ConfigError
from lib.agents.tools import (ResultRenderer, ToolWorker, environment_tools, load_environment, plain_tool_prompt,
                              start_tools, template_has_tools, tool_schemas, tool_spec, turn_tool_calls)
from lib.sampling.rollout import Rollout

ENVIRONMENT_COLUMN = "environment"  # TRL's: the data-set column that picks a row's environment by name


@dataclass
class Episode:
    """One completion of several turns. ids: its tokens after the prompt; model: 1 for the model's tokens, 0 for
    the tool results'; logps: the sampler's log-probability of each model token (0 at tool tokens); temperatures:
    each token's sampling temperature (1 at tool tokens: never sampled, and it keeps the forward's division finite);
    messages: its turns as chat messages, {"role": "assistant" | "tool", "content": text}, in order (the run view's
    and completions.jsonl's `turns`)."""

    ids: list[int] = field(default_factory=list)
    model: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    temperatures: list[float] = field(default_factory=list)
    calls: int = 0
    failures: int = 0
    turns: int = 0
    messages: list[dict] = field(default_factory=list)
    truncated: bool = False
    done: bool = False

    def add(self, ids: list[int], model: int, logps: list[float], temperatures: list[float]) -> None:
        self.ids += ids
        self.model += [model] * len(ids)
        self.logps += logps
        self.temperatures += temperatures

    def model_turn(self, ids: list[int], logps: list[float], temperatures: list[float], tokenizer) -> str:
        """A turn the model wrote appended (its tokens, counted, and its message): its text."""
        self.add(ids, 1, logps, temperatures)
        self.turns += 1
        text = tokenizer.decode(ids, skip_special_tokens=True)
        self.messages.append({"role": "assistant", "content": text})
        return text

    def run_calls(self, ids: list[int], text: str, tokenizer, call, renderer: ResultRenderer,
                  max_completion_length: int) -> bool:
        """The calls of the model's last turn (`ids`, `text`) run through `call`, their results appended as the
        chat template's tool messages, cut at the episode's room: whether the episode goes on (False: the turn
        called nothing, or no room is left for the model to read the results and answer: then it is truncated)."""
        calls, errors = turn_tool_calls(tokenizer, ids, text)
        if not calls and not errors:
            return False  # a turn that calls nothing ends the episode
        results = list(errors)
        for c in calls:
            result, failed = call(c.name, c.arguments)
            results.append(result)
            self.failures += failed
        self.messages += [{"role": "tool", "content": r} for r in results]
        self.calls += len(calls) + len(errors)
        self.failures += len(errors)
        tool_ids = renderer.ids(results)
        kept = tool_ids[:max_completion_length - len(self.ids)]
        self.add(kept, 0, [0.0] * len(kept), [1.0] * len(kept))
        if len(kept) < len(tool_ids) or len(self.ids) >= max_completion_length:
            self.truncated = True  # no room left for the model to read the result and answer
            return False
        return True


def engine_generate(engine, pad_token_id: int, sampling: dict, owner: torch.Tensor):
    """`run_episodes`' `generate` over a sampler with the trainer's interface (lib/sampling/rollout.HFRollout, vLLM's
    engines): each prompt left-padded, one completion each, at the batch's sampling settings `sampling` (a value
    given per prompt of the first turns, such as a controller's temperatures, is taken at each episode's prompt:
    `owner`, the first turns' prompt_index)."""
    def generate(prompts: list[list[int]], max_new_tokens: int, rows: list[int]) -> Rollout:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[row, width - len(p):] = 1
        index = owner[torch.tensor(rows, device=owner.device)]
        options = {k: v[index] if torch.is_tensor(v) and v.dim() == 1 else v for k, v in sampling.items()}
        return engine.generate(ids.to(owner.device), mask.to(owner.device), 1, max_new_tokens, **options)
    return generate


class Agent:
    """The episodes hook of lib/sampling/context.RolloutContext: a batch's first turns continued into episodes with the tools
    (`call`: lib/agents/tools.ToolWorker.call), and the batch's tool counters, TRL's `tools/call_frequency` (calls
    per completion) and `tools/failure_frequency` (failed calls per call). With environments (`environments`: {name:
    class spec}, the name None for a single class), `open_groups` starts each episode's instance before sampling."""

    def __init__(self, tokenizer, call, max_iterations: int | None, max_completion_length: int,
                 schemas: list[dict] | None = None, worker: ToolWorker | None = None,
                 environments: dict | None = None, environment_schemas: dict | None = None):
        self.tokenizer, self.call = tokenizer, call
        self.max_iterations, self.max_completion_length = max_iterations, max_completion_length
        self.schemas, self.worker = schemas or [], worker
        self.environments = environments or {}
        self.environment_schemas = environment_schemas or {}  # name -> the run's tools and the class's methods
        self.classes = {name: spec.rpartition(":")[2] for name, spec in self.environments.items()}
        self.renderer = ResultRenderer(tokenizer)
        self.next_episode = 0
        self.episode_class: dict[int, str] = {}  # open episode -> its environment's class name
        self.start_batch()

    @classmethod
    def from_config(cls, cfg, tokenizer) -> Agent | None:
        """The run's agent (`tools`, `environment_factory`), its worker started; None without either. A tool or an
        environment that cannot be imported or described raises ConfigError naming the key, before any sampling."""
        if not cfg.tools and not cfg.environment_factory:
            return None
        environments = environment_specs(cfg.environment_factory)
        try:  # (lib/agents/tools.start_tools, as the evaluator and the chat page build theirs)
            specs, schemas, worker = start_tools(cfg.tools, cfg.tool_timeout, environments, start=False)
        except ValueError as error:
            raise ConfigError(f"tools: {error}") from None
        environment_schemas = {}
        for name, spec in environments.items():
            try:
                environment_schemas[name] = tool_schemas(specs + environment_tools(load_environment(spec)))
            except ValueError as error:
                raise ConfigError(f"environment_factory: {spec}: {error} (its methods are tools, beside `tools`: "
                                  "each needs type hints and a Google-style docstring)") from None
        worker.start()  # once the environments' tools are described too
        return cls(tokenizer, worker.call, cfg.max_tool_calling_iterations, cfg.max_completion_length, schemas,
                   worker, environments, environment_schemas)

    @classmethod
    def for_run(cls, cfg, tokenizer, records: list[dict], reward_funcs: list) -> Agent | None:
        """`from_config`, then the run's checks before any model loads: every row picks an environment and each
        starts on its first row (`check_records`), and the environments' rewards (get_reward) fit the run's reward
        functions. ConfigError naming the key; the worker is stopped on a refusal."""
        agent = cls.from_config(cfg, tokenizer)
        if agent is None:
            return None
        try:
            agent.check_records(records)
        except ConfigError:
            agent.close()
            raise
        own = [name for name, _ in agent.reward_funcs()]
        clash = sorted(set(own) & {name for name, _ in reward_funcs})
        if clash or not (reward_funcs or own):
            agent.close()
            raise ConfigError(f"environment_factory: the reward of class {clash[0]} (its get_reward) would share its "
                              "name with a reward function; rename one" if clash else "reward_funcs is empty and no "
                              "environment_factory class has a get_reward method: give a reward function, or a "
                              "get_reward")
        return agent

    # ---------------------------------------------------------------------------------------------- environments
    def environment_of(self, record: dict):
        """The name of the environment a data-set row uses (None for a single class); ValueError naming the column
        and the names where the row picks none of them."""
        if None in self.environments:
            return None
        name = record.get(ENVIRONMENT_COLUMN)
        if name not in self.environments:
            given = "has no environment column" if ENVIRONMENT_COLUMN not in record else f"has environment={name!r}"
            raise ValueError(f"environment_factory maps names to classes, and a data-set row {given}; each row names "
                             f"its environment in the column {ENVIRONMENT_COLUMN!r}, one of "
                             f"{', '.join(map(str, self.environments))}")
        return name

    def check_records(self, records: list[dict]) -> None:
        """Before any model loads: every row picks a known environment, and each environment starts (one episode
        opened on the first row that uses it, and closed). ConfigError naming the key and the cause."""
        if not self.environments:
            return
        first = {}
        try:
            for record in records:
                first.setdefault(self.environment_of(record), record)
            for name, record in first.items():
                [episode] = self.open_episodes(name, record, 1)[1]
                self.drop(episode)
        except ValueError as error:  # a row picks no environment: the worker is not needed any more
            self.close()
            raise ConfigError(str(error)) from None
        except RuntimeError as error:  # an environment could not start
            self.close()
            raise ConfigError(f"{error}; checked on the first data-set row that uses it") from None

    def drop(self, episode: int) -> None:
        """An episode's environment dropped without its reward (opened, never sampled)."""
        self.worker.close_episode(episode)
        self.episode_class.pop(episode, None)

    def open_episodes(self, name, record: dict, count: int) -> tuple[str | None, list[int]]:
        """`count` episodes of environment `name` on one data-set row, each instance reset with the row (less the
        `environment` column where it picks the class): (the text reset returned, the episodes' ids). The episodes
        of one prompt share it, so their resets must return the same text: RuntimeError otherwise."""
        row = record if name is None else {k: v for k, v in record.items() if k != ENVIRONMENT_COLUMN}
        texts, ids = [], []
        for _ in range(count):
            ids.append(self.next_episode)
            self.episode_class[self.next_episode] = self.classes[name]
            self.next_episode += 1
            texts.append(self.worker.open(ids[-1], name, row))
        if len(set(texts)) > 1:
            for episode in ids:
                self.drop(episode)
            raise RuntimeError(f"environment_factory: {self.classes[name]}.reset returned different texts for the "
                               f"same data-set row ({texts[0]!r:.60} and {next(t for t in texts if t != texts[0])!r:.60}"
                               f"); the completions of one prompt share it (GRPO compares them), so reset must return "
                               "the same text for the same row: draw any randomness from the row's own columns")
        return texts[0] if texts else None, ids

    def open_groups(self, records: list[dict], counts: list[int]) -> tuple[list[dict], list[list[int]]]:
        """Each prompt's episodes opened (lib/sampling/context.RolloutContext.prompts): the records with the text their
        environment's reset returned appended to the prompt (`with_observation`), and each one's episode ids."""
        out, ids = [], []
        for record, count in zip(records, counts):
            text, episodes = self.open_episodes(self.environment_of(record), record, count)
            out.append(with_observation(record, text))
            ids.append(episodes)
        return out, ids

    def reward_funcs(self) -> list[tuple[str, object]]:
        """A reward function for each environment class with a get_reward method, named after the class (TRL's
        extra reward source, weight 1): it reads the `environment_reward` column the episodes fill."""
        funcs, seen = [], set()
        for name, spec in self.environments.items():
            cls = load_environment(spec)
            if callable(getattr(cls, "get_reward", None)) and cls.__name__ not in seen:
                seen.add(cls.__name__)
                funcs.append((cls.__name__, EnvironmentReward(cls.__name__)))
        return funcs

    # ---------------------------------------------------------------------------------------------- sampling
    def prompt_settings(self, system_prompt: str | None, template_kwargs: dict | None,
                        record: dict | None = None) -> tuple:
        """The system prompt and the chat template's variables that give the model the tools: the template's own
        `tools` where it renders them, else the plain format's description after the system prompt. With
        environments, a row's tools are the run's and its environment's (`record`; without one, or for a row that
        picks none, the run's)."""
        schemas = self.schemas
        if record is not None and self.environments:  # a row that picks none (a held-out set's): the run's tools
            name = None if None in self.environments else record.get(ENVIRONMENT_COLUMN)
            schemas = self.environment_schemas.get(name, self.schemas)
        if not schemas:
            return system_prompt, template_kwargs
        if template_has_tools(self.tokenizer):
            return system_prompt, {**(template_kwargs or {}), "tools": schemas}
        text = plain_tool_prompt(schemas)
        return (f"{system_prompt}\n\n{text}" if system_prompt else text), template_kwargs

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()

    def start_batch(self) -> None:
        self.calls = self.failures = self.completions = 0

    def generate(self, engine, prompts, rows: torch.Tensor | None, sampling: dict) -> Rollout:
        """lib/sampling/context.RolloutContext.generate's hook: the sampler `engine`'s first turns of lib/sampling/context.Prompts
        `prompts` (of its rows `rows`, or all) at `sampling`, continued into episodes (`__call__`)."""
        take = slice(None) if rows is None else rows
        first = engine.generate(prompts.ids[take], prompts.mask[take], prompts.counts[take],
                                self.max_completion_length, **sampling)
        return self(first, engine, sampling, prompts=prompts, rows=rows)

    def __call__(self, first: Rollout, engine, sampling: dict, episodes: list[int] | None = None, prompts=None,
                 rows: torch.Tensor | None = None) -> Rollout:
        """The episodes that go on from the sampler `engine`'s first turns `first`, sampled at `sampling`, counted
        in the batch's tool counters. `episodes`: each completion's episode id (`open_groups`), whose environment's
        methods are its tools; its environment is dropped when the episodes end, after its get_reward() (the
        rollout's `environment_reward`). The trainer's sampling (`generate`) gives the
        `prompts` sampled (and their `rows`) instead, whose episodes `episode_ids` finds."""
        if prompts is not None:
            episodes = self.episode_ids(prompts, rows)
        roll, done = self.run(first, engine, sampling, episodes)
        self.calls += sum(e.calls for e in done)
        self.failures += sum(e.failures for e in done)
        self.completions += len(done)
        return roll

    def episode_ids(self, prompts, rows: torch.Tensor | None) -> list[int] | None:
        """The episodes of the completions about to be sampled for `prompts` (lib/sampling/context.Prompts, or its rows
        `rows`), in completion order: those `prompts` opened, the first time; then new ones, their environments reset
        with the same rows (a refill's or a second round's), the text their reset returns checked against the
        prompt's."""
        if prompts.episodes is None:
            return None
        if rows is None and prompts.episodes:
            ids, prompts.episodes = [e for group in prompts.episodes for e in group], []  # used once
            return ids
        for episode in (e for group in prompts.episodes for e in group):  # opened, never sampled: dropped
            self.drop(episode)
        prompts.episodes, ids = [], []
        for row in (range(len(prompts.records)) if rows is None else rows.tolist()):
            source, count = prompts.sources[row], int(prompts.counts[row])
            [record], [group] = self.open_groups([source], [count])
            if record != prompts.records[row]:
                raise RuntimeError("environment_factory: reset returned another text for a data-set row when its "
                                   "prompt was sampled again; reset must return the same text for the same row")
            ids += group
        return ids

    def run(self, first: Rollout, engine, sampling: dict,
            episodes: list[int] | None = None) -> tuple[Rollout, list[Episode]]:
        """As `__call__`, counted nowhere (an evaluation's: lib/evaluation/accuracy.generate_and_score), with each Episode
        (its calls, failures, turns)."""
        generate = engine_generate(engine, self.tokenizer.pad_token_id, sampling, first.prompt_index)
        call = self.call if episodes is None else [partial(self.worker.call, episode=e) for e in episodes]
        done = run_episodes(generate, first, self.tokenizer, call, self.renderer, self.max_iterations,
                            self.max_completion_length)
        columns = {"turns": [e.messages for e in done]}  # the run view's and completions.jsonl's
        if episodes is not None:
            columns |= {"environment_reward": [], "environment_class": []}
            for episode in episodes:
                reward, error = self.worker.close_episode(episode)  # the instance is dropped
                # a failed get_reward travels as its message: EnvironmentReward raises it, scored as a failure
                columns["environment_reward"].append(reward if error is None else f"{error}")
                columns["environment_class"].append(self.episode_class.pop(episode, None))
        roll = episodes_rollout(first, done, self.tokenizer.pad_token_id)
        roll.columns = columns
        return roll, done

    def chat(self, sample, prompt_ids: list[int]):
        """One episode of one prompt, as it happens (the chat page's, chat_app.py): a generator that yields each
        piece of text the model writes (as `sample` yields it), then each finished message ({"role": "assistant" |
        "tool", "content": text}, those of Episode.messages), and returns the Episode. The same rules as
        `run_episodes`: a turn's calls run through `call`, their results are appended as the chat template's tool
        messages, and the model goes on from the prompt, its turns and the results, until a turn calls no tool,
        `max_iterations` turns have called tools, or the episode's tokens reach `max_completion_length`.

        `sample(ids: list[int], max_new_tokens: int)`: a generator of one model turn from the token ids `ids`,
        yielding its text as it comes and returning its new token ids (ending with the end-of-turn token unless it
        was cut). Nothing is counted in the batch's counters; logps are 0 (nothing here is trained)."""
        eos = self.tokenizer.eos_token_id
        episode = Episode()
        while True:
            room = self.max_completion_length - len(episode.ids)
            ids = (yield from sample(prompt_ids + episode.ids, room))[:room]
            text = episode.model_turn(ids, [0.0] * len(ids), [1.0] * len(ids), self.tokenizer)
            yield episode.messages[-1]
            episode.truncated = len(ids) >= room
            limit_reached = self.max_iterations is not None and episode.turns - 1 >= self.max_iterations
            if episode.truncated or limit_reached or ids[-1:] != [eos]:
                break
            seen = len(episode.messages)
            goes_on = episode.run_calls(ids, text, self.tokenizer, self.call, self.renderer,
                                        self.max_completion_length)
            yield from episode.messages[seen:]
            if not goes_on:
                break
        episode.done = True
        return episode

    def counters(self, reduce_sum) -> dict[str, float]:
        calls, failures = reduce_sum(self.calls), reduce_sum(self.failures)
        return {"tools/call_frequency": calls / max(reduce_sum(self.completions), 1.0),
                "tools/failure_frequency": failures / calls if calls else 0.0}


def run_episodes(generate, first: Rollout, tokenizer, call, renderer: ResultRenderer, max_iterations: int | None,
                 max_completion_length: int) -> list[Episode]:
    """Go on from the first turns `first` (a Rollout from the sampler) until every episode ends.

    `generate(prompt_ids: list[list[int]], max_new_tokens: int, rows: list[int]) -> Rollout` samples one
    continuation of each prompt, those of episodes `rows` (`engine_generate`: the sampler at the batch's settings);
    `call(name, arguments) -> (text, failed)` runs one tool (or a list of them, one per episode: each episode's
    environment's own, `Agent.__call__`). An episode ends when
    a turn calls no tool, when `max_iterations` turns have called tools (TRL's max_tool_calling_iterations; None: no
    limit), or when its tokens reach `max_completion_length` (then it is truncated, as a one-turn completion is)."""
    eos = tokenizer.eos_token_id
    prompts = [row[m.bool()].tolist() for row, m in zip(first.prompt_ids, first.prompt_mask)]
    owner = first.prompt_index.tolist()
    episodes = [Episode() for _ in owner]
    calls_of = call if isinstance(call, list) else [call] * len(episodes)
    turn, active, iteration = first, list(range(len(episodes))), 0
    while active:
        go_on = []
        limit_reached = max_iterations is not None and iteration >= max_iterations
        for k, i in enumerate(active):
            ep = episodes[i]
            # the new turn, cut to the episode's room (a call's budget is its longest episode's)
            room = max_completion_length - len(ep.ids)
            n = int(turn.completion_mask[k].sum())
            ids = turn.completion_ids[k, :min(n, room)].tolist()
            logps = turn.sampling_logps[k, :len(ids)].tolist() if turn.sampling_logps is not None else [0.0] * len(ids)
            text = ep.model_turn(ids, logps, turn.temperatures[k, :len(ids)].tolist(), tokenizer)
            ep.truncated = bool(turn.is_truncated[k]) or n >= room
            if ep.truncated or limit_reached or ids[-1:] != [eos]:
                continue
            if ep.run_calls(ids, text, tokenizer, calls_of[i], renderer, max_completion_length):
                go_on.append(i)
        for i in set(active) - set(go_on):
            episodes[i].done = True
        active = go_on
        if active:
            iteration += 1
            room = max(max_completion_length - len(episodes[i].ids) for i in active)
            turn = generate([prompts[owner[i]] + episodes[i].ids for i in active], room, active)
    return episodes


def episodes_rollout(first: Rollout, episodes: list[Episode], pad_token_id: int) -> Rollout:
    """The episodes as one Rollout: completion_ids (B, T) every token of each episode; completion_mask (B, T) its
    model tokens (what the trainer trains, regularises and counts); sequence_mask (B, T) all of its tokens (what the
    policy reads); sampling_logps 0 and temperatures 1 at tool tokens."""
    def padded(name: str, fill, dtype) -> torch.Tensor:
        return pad_sequence([torch.tensor(getattr(e, name), dtype=dtype) for e in episodes], batch_first=True,
                            padding_value=fill)

    ids, model = padded("ids", pad_token_id, torch.long), padded("model", 0, torch.long)
    logps, temperatures = padded("logps", 0.0, torch.float32), padded("temperatures", 0.0, torch.float32)
    sequence = pad_sequence([torch.ones(len(e.ids), dtype=torch.long) for e in episodes], batch_first=True)
    device = first.completion_ids.device
    return Rollout(first.prompt_ids, first.prompt_mask, ids.to(device), model.to(device),
                   torch.tensor([e.truncated for e in episodes], device=device),
                   temperatures.to(device=device, dtype=first.temperatures.dtype),
                   first.prompt_index, logps.to(device) if first.sampling_logps is not None else None,
                   sequence_mask=sequence.to(device))



def environment_specs(value) -> dict:
    """`environment_factory` as {name: 'module:Class' spec}: a class or its spec under the name None (every row
    uses it), or a mapping of names to either (a row picks one in its `environment` column). ConfigError naming the
    key, the entry and the fix, for what is not a class with a reset method."""
    if not value:
        return {}
    entries = value.items() if isinstance(value, dict) else [(None, value)]
    specs = {}
    for name, entry in entries:
        where = "environment_factory" if name is None else f"environment_factory[{name!r}]"
        try:
            spec = tool_spec(entry, "environment")
            load_environment(spec)
        except ValueError as error:
            raise ConfigError(f"{where}: {error}") from None
        specs[name] = spec
    return specs


def with_observation(record: dict, text: str | None) -> dict:
    """A data-set row with the text its environment's reset returned appended to the prompt's last message, as TRL
    does before the chat template (no separator): a conversation's last message, a text prompt's end, or a math
    problem's text (the run's instruction follows it, as always)."""
    if not text:
        return record
    if "prompt" not in record:
        return {**record, "problem": record["problem"] + text}
    prompt = record["prompt"]
    if isinstance(prompt, str):
        return {**record, "prompt": prompt + text}
    last = prompt[-1]
    if not isinstance(last.get("content"), str):
        raise ValueError("environment_factory: reset returned text, and the prompt's last message has no text content "
                         "to append it to")
    return {**record, "prompt": [*prompt[:-1], {**last, "content": last["content"] + text}]}


class EnvironmentReward:
    """The reward an environment class gives (its get_reward(), read when each episode ended): the
    `environment_reward` column at the completions whose environment is of class `name`, None elsewhere (TRL's
    rule: a row of another environment is not scored by it). A get_reward that failed raises its message here, and is
    scored as a failing reward function is (reward_error_value, counted). It runs in the trainer's process."""

    in_process = True  # lib/rewards/scoring.score_completions: not sent to the reward worker (it holds no columns' code)

    def __init__(self, name: str):
        self.name = self.__name__ = name

    def __call__(self, completions, environment_reward=None, environment_class=None, **kwargs) -> list:
        if environment_reward is None:  # completions without episodes (an evaluation's)
            return [None] * len(completions)
        out = []
        for value, cls in zip(environment_reward, environment_class):
            if cls == self.name and isinstance(value, str):
                raise RuntimeError(f"{self.name}.get_reward: {value}")
            out.append(value if cls == self.name else None)
        return out
