"""Agents (lib/agents/tools.py, lib/agents/episodes.py, docs/agents.md): tool schemas, the plain call format, the
tool worker's failures, the episode loop over the real HF sampler and its masks, a run with tools."""

import json
import math
import time

import pytest
import torch

from lib.agents.episodes import engine_generate, episodes_rollout, run_episodes
from lib.agents.tools import (ResultRenderer, ToolCall, ToolWorker, calculator, parse_tool_calls, plain_tool_prompt,
                              template_has_tools, tool_schemas, tool_spec)
from lib.sampling.rollout import Rollout
import conftest
from conftest import CALL, TOOLS

# the fixture: the tiny model taught to call `add` (tests/conftest.py; tests/test_agents_runs.py reads it from here)
tool_caller = conftest.tool_caller


def test_schemas_come_from_type_hints_and_docstrings_and_bad_tools_are_named():
    [schema] = tool_schemas([calculator])
    assert schema["function"]["name"] == "calculator"
    assert schema["function"]["parameters"]["required"] == ["expression"]
    assert tool_schemas([f"{TOOLS}:add"])[0]["function"]["parameters"]["properties"]["a"]["type"] == "integer"
    with pytest.raises(ValueError, match="tool 'untyped': .*type hint on every argument"):
        tool_schemas([f"{TOOLS}:untyped"])
    with pytest.raises(ValueError, match=r"tool names must be unique, got \['add'\]"):
        tool_schemas([f"{TOOLS}:add", f"{TOOLS}:add"])
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        tool_schemas([f"{TOOLS}:nope"])
    with pytest.raises(ValueError, match="a lambda or a nested function cannot be"):
        tool_spec(lambda x: x)
    assert tool_spec(calculator) == "lib.agents.tools:calculator"
    assert '"name": "calculator"' in plain_tool_prompt([schema]) and "<tool_call>" in plain_tool_prompt([schema])


def test_the_calculator_is_exact_and_refuses_what_is_not_arithmetic():
    assert calculator("(12 + 30) * 7 / 2") == "147"
    assert calculator("3 / 4") == "0.75" and calculator("2^10") == "1024" and calculator("-7 // 2") == "-4"
    for bad in ("__import__('os')", "2 ** 1000", "x + 1", "'a' * 3"):
        with pytest.raises(ValueError):
            calculator(bad)


def test_plain_calls_are_parsed_and_malformed_ones_become_messages():
    text = ('I will compute. <tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call> and '
            '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>')
    calls, errors = parse_tool_calls(text)
    assert calls == [ToolCall("calculator", {"expression": "2+3"}), ToolCall("add", {"a": 1, "b": 2})] and not errors
    calls, errors = parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>'
                                     '<tool_call>["add"]</tool_call>')
    assert calls == [] and len(errors) == 2
    assert errors[0].startswith("error: the tool call is not JSON") and '{"name": <tool name>' in errors[1]
    assert parse_tool_calls("no call here") == ([], [])


def test_results_are_appended_as_the_templates_tool_message(tokenizer):
    assert not template_has_tools(tokenizer)  # the embedded SmolLM2: the plain format
    ids = ResultRenderer(tokenizer).ids(["42"])
    # the model's turn ends with its end token; what follows closes the turn, is the tool's message, opens the next
    assert tokenizer.decode(ids) == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"


def test_the_tool_worker_turns_every_failure_into_a_message_and_goes_on():
    worker = ToolWorker([f"{TOOLS}:add", f"{TOOLS}:slow_double", f"{TOOLS}:broken", f"{TOOLS}:hangs",
                         f"{TOOLS}:dies", f"{TOOLS}:unprintable"], timeout=2.0)
    try:
        assert worker.call("add", {"a": 2, "b": 40}) == ("42", False)
        assert worker.call("slow_double", {"x": 21}) == ("42", False)
        text, failed = worker.call("broken", {"x": 1})
        assert failed and text == "error: broken raised ValueError: cannot handle 1"
        text, failed = worker.call("add", {"a": 1})
        assert failed and "TypeError" in text and "'b'" in text
        text, failed = worker.call("nope", {})
        assert failed and text.startswith("error: no tool named 'nope'; the tools are add, slow_double")
        text, failed = worker.call("unprintable", {"x": 1})
        assert failed and "RuntimeError: no text for this" in text
        start = time.perf_counter()
        text, failed = worker.call("hangs", {"x": 1})
        assert failed and "gave no answer within tool_timeout = 2 s" in text
        assert time.perf_counter() - start < 10
        text, failed = worker.call("dies", {"x": 1})
        assert failed and "killed the tool worker (exit code 3)" in text
        assert worker.call("add", {"a": 1, "b": 1}) == ("2", False)  # a fresh child after each
        assert worker.restarts == 2
    finally:
        worker.close()


def forced_turn(tokenizer, prompts: torch.Tensor, texts: list[str]) -> Rollout:
    """A first turn given as text (each ending with the end token), as a sampler's Rollout: the loop's mechanics on
    a model that cannot yet write a tool call."""
    rows = [tokenizer.encode(t, add_special_tokens=False) + [tokenizer.eos_token_id] for t in texts]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, :len(r)], mask[b, :len(r)] = torch.tensor(r), 1
    return Rollout(prompts, torch.ones_like(prompts), ids, mask, torch.zeros(len(rows), dtype=torch.bool),
                   torch.full((len(rows), width), 0.7) * mask, torch.arange(len(rows)), None)


@pytest.fixture(scope="module")
def engine(tiny_model):
    from lib.models.modeling import load_policy, load_tokenizer
    from lib.sampling.rollout import HFRollout

    tok = load_tokenizer(tiny_model)
    return HFRollout(load_policy(tiny_model), [tok.eos_token_id], tok.pad_token_id, seed=0)


def test_episodes_append_results_mask_them_and_end_at_each_limit(tokenizer, engine):
    prompt = torch.tensor([tokenizer.encode("<|im_start|>user\nWhat is 6 * 7?<|im_end|>\n<|im_start|>assistant\n",
                                            add_special_tokens=False)] * 3)
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "6 * 7"}}</tool_call>'
    texts = [call, "It is 42.", '<tool_call>["calculator", "6 * 7"]</tool_call>']
    worker = ToolWorker(["lib.agents.tools:calculator"], timeout=5.0)
    renderer = ResultRenderer(tokenizer)
    generate = engine_generate(engine, tokenizer.pad_token_id, {"temperature": 0.7}, torch.arange(3))
    try:
        torch.manual_seed(0)
        first = forced_turn(tokenizer, prompt, texts)
        episodes = run_episodes(generate, first, tokenizer, worker.call, renderer, max_iterations=1,
                                max_completion_length=120)
    finally:
        worker.close()
    called, plain, malformed = episodes
    result = renderer.ids(["42"])
    n = len(first.completion_ids[0][first.completion_mask[0].bool()])
    # the call's turn, then the result (not the model's), then the model's next turn
    assert called.ids[n:n + len(result)] == result and called.model[n:n + len(result)] == [0] * len(result)
    assert called.model[:n] == [1] * n and set(called.model[n + len(result):]) == {1}
    assert (called.calls, called.failures, called.turns) == (1, 0, 2) and called.done
    assert [m["role"] for m in called.messages] == ["assistant", "tool", "assistant"]
    assert called.messages[0]["content"] == call and called.messages[1]["content"] == "42"
    assert (plain.calls, plain.turns, set(plain.model)) == (0, 1, {1})  # no call: the episode ends with its turn
    assert (malformed.calls, malformed.failures) == (1, 1)
    assert "error: a tool call is" in tokenizer.decode(malformed.ids)
    roll = episodes_rollout(first, episodes, tokenizer.pad_token_id)
    assert torch.equal(roll.completion_mask[0, :len(called.ids)], torch.tensor(called.model))
    assert int(roll.sequence_mask[0].sum()) == len(called.ids) and int(roll.completion_mask[0].sum()) < len(called.ids)
    assert roll.temperatures[0, :len(called.ids)].tolist() == pytest.approx([0.7 if m else 1.0 for m in called.model])

    # max_tool_calling_iterations 0: the call is not run; a budget the result does not fit in: truncated
    worker = ToolWorker(["lib.agents.tools:calculator"], timeout=5.0)
    try:
        [none] = run_episodes(generate, forced_turn(tokenizer, prompt[:1], [call]), tokenizer, worker.call,
                              renderer, max_iterations=0, max_completion_length=120)
        assert (none.calls, none.turns, none.truncated) == (0, 1, False)
        short = n + 3
        [cut] = run_episodes(generate, forced_turn(tokenizer, prompt[:1], [call]), tokenizer, worker.call,
                             renderer, max_iterations=None, max_completion_length=short)
        assert len(cut.ids) == short and cut.truncated and cut.calls == 1 and cut.model[n:] == [0, 0, 0]
        [budget] = run_episodes(generate, forced_turn(tokenizer, prompt[:1], [call]), tokenizer, worker.call,
                                renderer, max_iterations=None, max_completion_length=n + len(result) + 5)
        assert len(budget.ids) <= n + len(result) + 5 and budget.truncated and budget.turns == 2
    finally:
        worker.close()


@pytest.mark.slow  # a model taught to call the tool, then a run: about 20 s
def test_a_run_with_tools_trains_only_the_models_tokens(tool_caller, tmp_path, monkeypatch):
    """The loop with `tools`: episodes of two turns, the tool's result read by the model but no gradient reaching
    it (the loss's gradient at every tool-result token is exactly 0, at the model's tokens it is not), the tool
    counters logged, the turns in completions.jsonl."""
    import train_agrpo
    from accelerate.state import AcceleratorState
    from lib.models.modeling import CompletionScorer

    captured, batches = [], []
    forward = CompletionScorer.forward

    def keep(self, *args, **kwargs):  # the real forward; its log-probs kept to read their gradient
        logp, entropy = forward(self, *args, **kwargs)
        if logp.requires_grad:
            logp.retain_grad()
            captured.append(logp)
        return logp, entropy

    prepare = train_agrpo.prepare_batch
    monkeypatch.setattr(CompletionScorer, "forward", keep)
    monkeypatch.setattr(train_agrpo, "prepare_batch", lambda *parts: batches.append(prepare(*parts)) or batches[-1])
    torch.set_num_threads(1)
    out = tmp_path / "run"
    try:
        train_agrpo.main(["--model_name_or_path", tool_caller, "--max_steps", "2", "--per_device_train_batch_size",
                          "4", "--num_generations", "4", "--max_completion_length", "64", "--num_eval_samples", "0",
                          "--builtin_num_train", "4", "--seed", "0", "--learning_rate", "1e-4", "--temperature", "0.3",
                          "--reward_funcs", "tests/tiny_rewards.py:noise", "--bf16", "false", "--beta", "0.04",
                          "--eta", "0.01", "--tools", f"{TOOLS}:add", "--max_tool_calling_iterations", "2",
                          "--output_dir", str(out)])
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "reward" in m]
    assert steps[0]["tools/call_frequency"] >= 1.0 and steps[0]["tools/failure_frequency"] == 0.0
    assert len(batches) == 2 and len(captured) == 2
    for batch, logp in zip(batches, captured):
        roll = batch.rollout
        width = logp.shape[1]
        tool = (roll.attended() - roll.completion_mask)[:, :width].bool()
        assert tool.any(), "no episode called the tool"
        assert torch.all(logp.grad[tool] == 0)
        assert logp.grad[roll.completion_mask[:, :width].bool()].abs().max() > 0
        # the model's tokens counted: lengths and the token budget leave the tool's out
        assert batch.num_tokens == int(roll.completion_mask.sum()) < int(roll.attended().sum())
    completions = [json.loads(x) for x in (out / "completions.jsonl").read_text().splitlines()]
    assert any("tool\n5" in c["completion"] for c in completions)
    # each episode turn by turn, and the run view's completions browser showing the call and the result apart
    from lib.apps.page import completion_detail, split_reasoning
    from lib.apps.runs import completion_rows, load_run

    called = [c for c in completions if len(c.get("turns", [])) == 3]
    assert called and all([t["role"] for t in c["turns"]] == ["assistant", "tool", "assistant"] and
                          c["turns"][0]["content"] == CALL and c["turns"][1]["content"] == "5" for c in called)
    row = next(r for r in completion_rows(load_run(out), split_reasoning) if r["turns"] and len(r["turns"]) == 3)
    messages, _ = completion_detail(row)
    assert [m.get("metadata", {}).get("title") for m in messages[1:3]] == ["Tool call", "Tool result"]
    assert CALL in messages[1]["content"] and messages[2]["content"] == "```\n5\n```"


# ---------------------------------------------------------------------------------------------------------------
# Environments (environment_factory, docs/agents.md 7)

ENVS = {"counter": f"{TOOLS}:Counter", "store": f"{TOOLS}:Store"}


def test_environment_factory_is_read_from_yaml_and_the_command_line_and_bad_specs_name_the_key(tmp_path):
    from lib.config import ConfigError, make_config, parse_config
    from lib.agents.episodes import environment_specs
    from lib.agents.tools import environment_methods, environment_tools, load_environment
    from tiny_tools import Counter

    assert parse_config(["--environment_factory", ENVS["counter"]]).environment_factory == ENVS["counter"]
    assert parse_config(["--environment_factory", json.dumps(ENVS)]).environment_factory == ENVS
    recipe = tmp_path / "envs.yaml"
    recipe.write_text("environment_factory:\n  counter: tests/tiny_tools.py:Counter\n  store: tests/tiny_tools.py:Store\n")
    assert parse_config(["--config", str(recipe)]).environment_factory == ENVS
    # a Python user's class (or function, in tools) is recorded by name: the worker imports it, config.yaml holds it
    assert make_config({"environment_factory": Counter}).environment_factory == "tiny_tools:Counter"
    assert make_config({"environment_factory": {"c": Counter}, "tools": [calculator]}).tools == [
        "lib.agents.tools:calculator"]
    with pytest.raises(ConfigError, match=r"environment_factory: a mapping gives each name a 'module:Class'"):
        parse_config(["--environment_factory", '{"counter": 3}'])
    # TRL's rule: the class's public functions, less reset and get_reward; a class, with a reset
    assert environment_methods(load_environment(ENVS["counter"])) == ["explode", "increment", "stall"]
    [increment] = [s for s in tool_schemas(environment_tools(Counter)) if s["function"]["name"] == "increment"]
    assert increment["function"]["parameters"]["required"] == ["by"]  # no `self`
    assert environment_specs(Counter) == {None: "tiny_tools:Counter"}
    assert environment_specs(ENVS) == ENVS
    for bad, message in [(f"{TOOLS}:NoReset", r"environment_factory: .*class NoReset has no reset method"),
                         (f"{TOOLS}:add", r"environment_factory: .*'tests/tiny_tools.py:add' is a function, not a class"),
                         (f"{TOOLS}:Nope", r"environment_factory: .*has no attribute 'Nope'"),
                         ({"a": f"{TOOLS}:NoReset"}, r"environment_factory\['a'\]: .*no reset method")]:
        with pytest.raises(ConfigError, match=message):
            environment_specs(bad)


def test_each_episode_has_its_own_environment_in_the_worker_until_it_ends():
    from lib.agents.tools import EnvironmentFailed

    worker = ToolWorker([f"{TOOLS}:add"], timeout=2.0, environments={
        None: ENVS["counter"], "store": ENVS["store"], "bad": f"{TOOLS}:BadReset"})
    try:
        assert worker.open(0, None, {"start": 5}) == " The counter starts at 5."
        assert worker.open(1, None, {"start": 5}) == " The counter starts at 5."
        assert worker.call("increment", {"by": 2}, episode=0) == ("7", False)
        assert worker.call("increment", {"by": 3}, episode=0) == ("10", False)  # the state persists in the episode
        assert worker.call("increment", {"by": 1}, episode=1) == ("6", False)  # and is the episode's own
        assert worker.call("add", {"a": 1, "b": 2}, episode=0) == ("3", False)  # the run's tools beside the methods
        assert worker.call("explode", {}, episode=1) == ("error: explode raised RuntimeError: boom at 6", True)
        text, failed = worker.call("_hidden", {}, episode=1)
        assert failed and text.startswith("error: no tool named '_hidden'; the tools are add, explode, increment")
        assert worker.call("increment", {"by": 1}) == ("error: no tool named 'increment'; the tools are add", True)
        assert worker.close_episode(0) == (10.0, None)  # get_reward, then the instance is dropped
        assert worker.call("increment", {"by": 1}, episode=0)[1]
        assert worker.open(2, "store", {}) is None  # reset returned nothing: nothing is appended
        assert worker.call("put", {"key": "k", "value": "v"}, episode=2) == ("ok", False)
        assert worker.call("get", {"key": "k"}, episode=2) == ("v", False)
        assert worker.open(3, "store", {}) is None and worker.call("get", {"key": "k"}, episode=3) == ("missing", False)
        with pytest.raises(EnvironmentFailed, match=r"BadReset.reset raised KeyError: 'no such level' \(the data-set "
                                                    r"row's columns: level\)"):
            worker.open(4, "bad", {"level": 7})
        start = time.perf_counter()
        text, failed = worker.call("stall", {}, episode=1)  # hangs: the worker is restarted, the run goes on
        assert failed and "gave no answer within tool_timeout = 2 s" in text and time.perf_counter() - start < 10
        text, failed = worker.call("get", {"key": "k"}, episode=2)  # the episodes of the killed child are lost
        assert failed and "environment is gone" in text
        assert worker.close_episode(1) == (None, "its environment is gone (the tool worker was restarted after a "
                                                 "call hung or killed it)")
        assert worker.call("add", {"a": 1, "b": 1}) == ("2", False)
    finally:
        worker.close()


def environment_agent(tokenizer, environments, tools=(), timeout=5.0, max_iterations=1, max_completion_length=80):
    from types import SimpleNamespace

    from lib.agents.episodes import Agent

    cfg = SimpleNamespace(tools=list(tools), environment_factory=environments, tool_timeout=timeout,
                          max_tool_calling_iterations=max_iterations, max_completion_length=max_completion_length)
    return Agent.from_config(cfg, tokenizer)


def call_text(name: str, **arguments) -> str:
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def test_environment_episodes_over_the_hf_sampler(tokenizer, engine):
    """A batch of two prompts, two episodes each, one row per environment (picked by the `environment` column): the
    reset's text in the prompt, each episode's own state, the other environment's methods refused, a raising method
    counted, get_reward in the rollout's columns and through the reward function named after the class."""
    from lib.config import ConfigError
    from lib.data.records import render_prompt
    from lib.agents.episodes import EnvironmentReward

    agent = environment_agent(tokenizer, ENVS)
    try:
        rows = [{"prompt": [{"role": "user", "content": "Count."}], "start": 5, "environment": "counter"},
                {"prompt": [{"role": "user", "content": "Store."}], "environment": "store"}]
        with pytest.raises(ConfigError, match=r"data-set row has environment='nope'; .* column 'environment', one of "
                                              r"counter, store"):
            agent.check_records(rows + [{"prompt": "x", "environment": "nope"}])
        agent.check_records(rows)  # each environment starts on its first row
        records, ids = agent.open_groups(rows, [2, 2])
        assert records[0]["prompt"][-1]["content"] == "Count. The counter starts at 5."  # appended, before the template
        assert records[1] == rows[1] and len({*ids[0], *ids[1]}) == 4
        # each row's prompt describes its own environment's tools
        system, kwargs = agent.prompt_settings(None, None, records[0])
        assert '"name": "increment"' in system and '"name": "put"' not in system
        system, kwargs = agent.prompt_settings(None, None, records[1])
        assert '"name": "put"' in system and '"name": "increment"' not in system
        text = render_prompt(tokenizer, records[0], system_prompt=agent.prompt_settings(None, None, records[0])[0])
        assert text.endswith("Count. The counter starts at 5.<|im_end|>\n<|im_start|>assistant\n")

        prompt = torch.tensor([tokenizer.encode(render_prompt(tokenizer, r), add_special_tokens=False)[-12:]
                               for r in records])
        first = forced_turn(tokenizer, prompt, [
            call_text("increment", by=2) + call_text("increment", by=3),  # one state across the turn's calls
            call_text("increment", by=1) + call_text("explode"),  # its own counter; a raising method is counted
            call_text("put", key="k", value="v") + call_text("increment", by=1),  # not a tool of the store's
            "Nothing to do."])
        first.prompt_index = torch.tensor([0, 0, 1, 1])
        torch.manual_seed(0)
        roll = agent(first, engine, {"temperature": 0.7}, episodes=[e for group in ids for e in group])
        texts = [tokenizer.decode(row[:int(n)]) for row, n in zip(roll.completion_ids, roll.attended().sum(1))]
        assert "tool\n7<|im_end|>" in texts[0] and "tool\n10<|im_end|>" in texts[0]
        assert "tool\n6<|im_end|>" in texts[1] and "error: explode raised RuntimeError: boom at 6" in texts[1]
        assert "tool\nok<|im_end|>" in texts[2] and "error: no tool named 'increment'" in texts[2]
        assert (agent.calls, agent.failures, agent.completions) == (6, 2, 4)
        # get_reward when the episodes end (the store has none), then the instances are dropped
        assert roll.columns["environment_reward"] == [10.0, 6.0, None, None]
        assert roll.columns["environment_class"] == ["Counter", "Counter", "Store", "Store"]
        assert agent.worker.call("increment", {"by": 1}, episode=ids[0][0])[1] and not agent.worker.opened
        [(name, reward)] = agent.reward_funcs()
        assert name == "Counter" and reward(["a"] * 4, **roll.columns) == [10.0, 6.0, None, None]
        # a get_reward that failed raises in its own class's reward function only (scored as a failing function)
        with pytest.raises(RuntimeError, match="Counter.get_reward: it broke"):
            reward(["a"] * 2, environment_reward=["it broke", None], environment_class=["Counter", "Store"])
        assert EnvironmentReward("Store")(["a"] * 2, environment_reward=["it broke", None],
                                          environment_class=["Counter", "Store"]) == [None, None]
        # reset must give the G episodes of one prompt the same text
        with pytest.raises(RuntimeError, match="reset returned different texts for the same data-set row"):
            agent.open_groups([{"prompt": "x", "environment": "counter", "start": "random"}], [2])
        assert not agent.worker.opened
    finally:
        agent.close()


def test_a_run_with_environments_scores_get_reward_and_shows_resets_text(tiny_model, tmp_path):
    """The trainer with `environment_factory` (two classes picked by the rows' column): each prompt carries its
    environment's reset text, the Counter's get_reward is a reward of its own (weight 1) on its rows only."""
    import train_agrpo
    from accelerate.state import AcceleratorState

    data = tmp_path / "rows.jsonl"
    rows = [{"prompt": [{"role": "user", "content": f"Count {i}."}], "start": 3, "environment": "counter"}
            for i in range(2)] + [{"prompt": [{"role": "user", "content": f"Store {i}."}], "environment": "store"}
                                  for i in range(2)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train_agrpo.main(["--model_name_or_path", tiny_model, "--dataset_name", str(data), "--max_steps", "2",
                          "--per_device_train_batch_size", "8", "--num_generations", "4",
                          "--max_completion_length", "8", "--num_eval_samples", "0", "--learning_rate", "1e-3",
                          "--reward_funcs", "tests/tiny_rewards.py:noise", "--bf16", "false",
                          "--environment_factory", json.dumps(ENVS), "--output_dir", str(out)])
    finally:
        torch.set_num_threads(threads)
        AcceleratorState._reset_state(reset_partial_state=True)
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if "reward" in m]
    # the Counter's rows score their start (nothing incremented it); the store's are not scored by it (NaN)
    counter = [m["rewards/Counter/mean"] for m in steps]
    assert len(steps) == 2 and 3.0 in counter and all(v == 3.0 or math.isnan(v) for v in counter)
    completions = [json.loads(x) for x in (out / "completions.jsonl").read_text().splitlines()]
    counted = [c["prompt"] for c in completions if "Count " in c["prompt"]]
    assert counted and all("Count 0. The counter starts at 3." in p or "Count 1. The counter starts at 3." in p
                           for p in counted)
    assert all("starts at" not in c["prompt"] for c in completions if "Store " in c["prompt"])
    assert all('"name": "increment"' in p for p in counted)  # the row's environment's tools in its prompt


def test_a_run_stops_before_training_on_a_bad_environment(tiny_model, tmp_path):
    import train_agrpo
    from accelerate.state import AcceleratorState
    from lib.config import ConfigError

    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "x", "level": 1}) + "\n")
    args = ["--model_name_or_path", tiny_model, "--dataset_name", str(data), "--max_steps", "1",
            "--per_device_train_batch_size", "4", "--num_generations", "4", "--num_eval_samples", "0",
            "--reward_funcs", "tests/tiny_rewards.py:noise", "--output_dir", str(tmp_path / "run")]
    try:
        with pytest.raises(ConfigError, match=r"environment_factory: BadReset.reset raised KeyError: 'no such level' "
                                              r"\(the data-set row's columns: prompt, level\); checked on the first"):
            train_agrpo.main(args + ["--environment_factory", f"{TOOLS}:BadReset"])
        with pytest.raises(ConfigError, match=r"environment_factory maps names to classes, and a data-set row has no "
                                              r"environment column"):
            train_agrpo.main(args + ["--environment_factory", json.dumps(ENVS)])
        recipe = tmp_path / "no_rewards.yaml"
        recipe.write_text(f"reward_funcs: []\nenvironment_factory: {ENVS['store']}\n")
        with pytest.raises(ConfigError, match="reward_funcs is empty and no environment_factory class has a "
                                              "get_reward method"):
            without_rewards = [a for a in args if a not in ("--reward_funcs", "tests/tiny_rewards.py:noise")]
            train_agrpo.main(without_rewards + ["--config", str(recipe)])
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_groups_sampled_again_get_fresh_environments(tiny_model, tmp_path):
    """adaGRPO samples the groups with no correct answer again (RolloutContext.sample_again): their new episodes get
    new instances, reset with the same rows, and their get_reward replaces the old completions' in the batch."""
    import train_agrpo
    from accelerate.state import AcceleratorState

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"Count {i}."}], "start": 3}) + "\n"
                            for i in range(4)))
    out = tmp_path / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train_agrpo.main(["--model_name_or_path", tiny_model, "--dataset_name", str(data), "--max_steps", "2",
                          "--algo", "adagrpo", "--per_device_train_batch_size", "8", "--num_generations", "4",
                          "--max_completion_length", "8", "--num_eval_samples", "0", "--bf16", "false",
                          "--reward_funcs", "tests/tiny_rewards.py:has_x", "--correctness_reward", "has_x",
                          "--environment_factory", f"{TOOLS}:Counter", "--output_dir", str(out)])
    finally:
        torch.set_num_threads(threads)
        AcceleratorState._reset_state(reset_partial_state=True)
    steps = [m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "reward" in m]
    assert all(m["resampled_prompts"] > 0 for m in steps)  # the rows path ran
    # every completion's get_reward read (a closed or reused episode would have failed: counted as an error)
    assert [(m["rewards/Counter/mean"], m["rewards/Counter/errors"]) for m in steps] == [(3.0, 0.0), (3.0, 0.0)]


# ---------------------------------------------------------------------------------------------------------------
# rollout_func (docs/agents.md 8)


def test_rollout_func_contract_and_config_errors_name_the_key(tokenizer):
    from types import SimpleNamespace

    from lib.config import ConfigError, make_config, parse_config
    from lib.agents.rollout_func import RolloutFunction
    from tiny_tools import rollout_with_feedback

    assert parse_config(["--rollout_func", f"{TOOLS}:rollout_with_feedback"]).rollout_func == \
        f"{TOOLS}:rollout_with_feedback"
    assert make_config({"rollout_func": rollout_with_feedback}).rollout_func == "tiny_tools:rollout_with_feedback"
    with pytest.raises(ConfigError, match="rollout_func samples the completions itself.*without tools or "
                                          "environment_factory"):
        make_config({"rollout_func": rollout_with_feedback, "tools": ["lib.agents.tools:calculator"]})
    cfg = SimpleNamespace(rollout_func=f"{TOOLS}:nope", max_completion_length=6, temperature=0.7)
    accelerator = SimpleNamespace(device=torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"rollout_func: rollout_func 'tests/tiny_tools.py:nope': module .* has no "
                                          r"attribute 'nope'"):
        RolloutFunction.from_config(cfg, tokenizer, accelerator)
    cfg.rollout_func = f"{TOOLS}:rollout_with_feedback"
    hook = RolloutFunction.from_config(cfg, tokenizer, accelerator)
    owner = torch.tensor([0, 0, 1, 1])
    eos = tokenizer.eos_token_id
    good = {"prompt_ids": [[1, 2], [1, 2], [3], [3]], "completion_ids": [[5, eos], [5, 6, 7, 8, 9, 10, 11], [7], []],
            "logprobs": [[-0.5, -0.25], [-1.0] * 7, [-2.0], []], "env_mask": [[1, 1], [1, 0, 0, 1, 1, 1, 1], [0], []],
            "score": [1, 2, 3, 4], "tag": "all"}
    roll = hook.to_rollout(good, owner, {"temperature": torch.tensor([0.5, 0.9])})
    assert roll.prompt_ids.tolist() == [[1, 2], [tokenizer.pad_token_id, 3]] and roll.prompt_mask.tolist() == [
        [1, 1], [0, 1]]
    assert roll.completion_ids.shape == (4, 6) and roll.is_truncated.tolist() == [False, True, True, True]
    assert roll.completion_mask[1].tolist() == [1, 0, 0, 1, 1, 1] and roll.sequence_mask[1].tolist() == [1] * 6
    assert roll.temperatures[1].tolist() == pytest.approx([0.5, 1, 1, 0.5, 0.5, 0.5])  # env tokens: 1
    assert roll.temperatures[2, 0].item() == 1.0 and roll.sampling_logps[1, :3].tolist() == [-1.0, 0.0, 0.0]
    assert roll.columns == {"score": [1, 2, 3, 4], "tag": ["all"] * 4}  # TRL's rule: a non-list goes to every row
    for bad, message in [({k: v for k, v in good.items() if k != "logprobs"}, r"must return keys \['logprobs'\]"),
                         ({**good, "completion_ids": good["completion_ids"][:3]}, "returned 3 completion_ids for 4"),
                         ({**good, "prompt_ids": [[1, 2], [1], [3], [3]]}, "different prompt_ids for completions of "
                                                                           "the same prompt"),
                         ({**good, "score": [1]}, "'score' has 1 values for 4 completions"),
                         ([1, 2], "must return a dict")]:
        with pytest.raises(ValueError, match=message):
            hook.to_rollout(bad, owner, {"temperature": 0.7})


def test_a_run_with_rollout_func_trains_on_its_completions(tiny_model, tmp_path):
    """The trainer with `rollout_func`: the function samples (through the trainer's own sampler) and appends an
    environment's feedback; the feedback is read but not trained (env_mask), its extra field reaches a reward
    function."""
    import train_agrpo
    from accelerate.state import AcceleratorState
    from tiny_tools import FEEDBACK

    out = tmp_path / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train_agrpo.main(["--model_name_or_path", tiny_model, "--max_steps", "2", "--per_device_train_batch_size", "8",
                          "--num_generations", "4", "--max_completion_length", "16", "--num_eval_samples", "2",
                          "--builtin_num_train", "8", "--bf16", "false", "--reward_funcs", f"{TOOLS}:feedback",
                          "--rollout_func", f"{TOOLS}:rollout_with_feedback", "--output_dir", str(out)])
    finally:
        torch.set_num_threads(threads)
        AcceleratorState._reset_state(reset_partial_state=True)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "reward" in m]
    assert len(steps) == 2
    # the evaluations (before and after) sample with the trainer's sampler: no feedback, no tool counters
    evals = [m for m in lines if "eval/accuracy" in m]
    assert [m["step"] for m in evals] == [0, 2] and all("eval/tool_calls" not in m for m in evals)
    for m in steps:  # the model's 4 tokens (or fewer, where it ended): the feedback is not the model's
        assert m["rewards/feedback/mean"] == m["completions/mean_length"] <= 4 and m["rewards/feedback/errors"] == 0
    completions = [json.loads(x) for x in (out / "completions.jsonl").read_text().splitlines()]
    assert completions and all(c["completion"].endswith(FEEDBACK) for c in completions)


def test_the_pages_environment_example_runs(tiny_model, tmp_path, monkeypatch):
    """docs/agents.md 7's example as it is written (its class, its data, its recipe), for one step on the tiny model:
    get_reward as the only reward."""
    import re

    import train_agrpo
    from accelerate.state import AcceleratorState
    from conftest import REPO

    page = (REPO / "docs" / "agents.md").read_text()
    section = page[page.index("## 7. Environments"):page.index("## 8.")]
    blocks = {}
    for kind, text in re.findall(r"```(python|json lines|yaml)\n(.*?)```", section, re.S):
        blocks.setdefault(kind, text)  # the first of each kind: the example's three files
    (tmp_path / "guess_env.py").write_text(blocks["python"])
    (tmp_path / "guesses.jsonl").write_text(blocks["json lines"])
    (tmp_path / "guess.yaml").write_text(blocks["yaml"])
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train_agrpo.main(["--config", "guess.yaml", "--model_name_or_path", tiny_model, "--max_steps", "1",
                          "--per_device_train_batch_size", "4", "--num_generations", "4", "--max_completion_length",
                          "16", "--bf16", "false", "--output_dir", str(tmp_path / "run")])
    finally:
        torch.set_num_threads(threads)
        AcceleratorState._reset_state(reset_partial_state=True)
    [step] = [m for m in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) if "reward" in m]
    assert step["rewards/GuessTheNumber/mean"] == 0.0 and step["rewards/GuessTheNumber/errors"] == 0  # no guess yet
    [line] = [json.loads(x) for x in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()][:1]
    assert "Let's play a game. Guess my number, from 1 to 100, with the guess tool." in line["prompt"]
    assert '"name": "guess"' in line["prompt"]
