"""Agents (lib/extras/tools.py, lib/extras/agents.py, docs/agents.md): tool schemas, the plain call format, the tool worker's failures,
the episode loop over the real HF sampler and its masks."""

import time

import pytest
import torch

from lib.extras.agents import engine_generate, episodes_rollout, run_episodes
from lib.extras.tools import (ResultRenderer, ToolCall, ToolWorker, calculator, parse_tool_calls, plain_tool_prompt,
                              template_has_tools, tool_schemas, tool_spec)
from lib.rollout import Rollout

TOOLS = "tests/tiny_tools.py"


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
    assert tool_spec(calculator) == "lib.extras.tools:calculator"
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
    from lib.modeling import load_policy, load_tokenizer
    from lib.rollout import HFRollout

    tok = load_tokenizer(tiny_model)
    return HFRollout(load_policy(tiny_model), [tok.eos_token_id], tok.pad_token_id, seed=0)


def test_episodes_append_results_mask_them_and_end_at_each_limit(tokenizer, engine):
    prompt = torch.tensor([tokenizer.encode("<|im_start|>user\nWhat is 6 * 7?<|im_end|>\n<|im_start|>assistant\n",
                                            add_special_tokens=False)] * 3)
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "6 * 7"}}</tool_call>'
    texts = [call, "It is 42.", '<tool_call>["calculator", "6 * 7"]</tool_call>']
    worker = ToolWorker(["lib.extras.tools:calculator"], timeout=5.0)
    renderer = ResultRenderer(tokenizer)
    generate = engine_generate(engine, tokenizer.pad_token_id, temperature=0.7)
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
    assert (plain.calls, plain.turns, set(plain.model)) == (0, 1, {1})  # no call: the episode ends with its turn
    assert (malformed.calls, malformed.failures) == (1, 1)
    assert "error: a tool call is" in tokenizer.decode(malformed.ids)
    roll = episodes_rollout(first, episodes, tokenizer.pad_token_id)
    assert torch.equal(roll.completion_mask[0, :len(called.ids)], torch.tensor(called.model))
    assert int(roll.sequence_mask[0].sum()) == len(called.ids) and int(roll.completion_mask[0].sum()) < len(called.ids)
    assert (roll.temperatures[0] > 0).tolist() == [bool(m) for m in roll.completion_mask[0].tolist()]

    # max_tool_calling_iterations 0: the call is not run; a budget the result does not fit in: truncated
    worker = ToolWorker(["lib.extras.tools:calculator"], timeout=5.0)
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
