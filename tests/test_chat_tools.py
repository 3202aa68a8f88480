"""The chat page with tools (chat_app.py, docs/agents.md 9.1): each answer an episode, its tool calls run in the page's
worker and shown apart from the answer; bad tool options refused before any model loads."""

import sys

import pytest

from conftest import REPO
from test_agents import CALL, TOOLS

sys.path.insert(0, str(REPO))
from chat_app import PageTools, Slot, build_app, main, page_tools, parse_args  # noqa: E402
from lib.data.records import DEFAULT_INSTRUCTION  # noqa: E402
from lib.data.word_problems import builtin_task  # noqa: E402
from lib.apps.page import assistant_messages, model_messages, read_conversation  # noqa: E402
from lib.agents.tools import plain_tool_prompt, tool_schemas  # noqa: E402


@pytest.fixture
def run_with_tools(tool_caller, tmp_path):
    """A run folder as the trainer leaves it after a run with tools: config.yaml naming them, final/ the model."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(tool_caller, run / "final")
    (run / "config.yaml").write_text(f"model_name_or_path: {tool_caller}\ntools: [{TOOLS}:add]\n"
                                     "max_tool_calling_iterations: 2\ntool_timeout: 5.0\n")
    return run


def test_an_answer_with_tools_shows_the_call_the_result_and_the_final_turn(run_with_tools, monkeypatch):
    from chat_app import resolve_models

    monkeypatch.chdir(REPO)  # the run's tool spec is a file path, read from where the page starts
    args = parse_args(["--model_name_or_path", str(run_with_tools / "final"), "--reward_funcs", "accuracy"])
    name, base_name, run_dir, settings = resolve_models(args)
    tools = page_tools(args, settings)  # the run's own tools and limits, from its config.yaml
    assert isinstance(tools, PageTools) and tools.specs == [f"{TOOLS}:add"] and tools.max_iterations == 2
    assert tools.worker.timeout == 5.0
    checkpoint = Slot("checkpoint")
    assert checkpoint.load(name).endswith("loaded " + name)
    app = build_app(checkpoint, Slot("base"), args, run_dir, settings, tools=tools)
    send = {d.api_name: d.fn for d in app.fns.values() if d.api_name}["send"]
    problem = builtin_task(seed=0, num_train=4, num_eval=0)[0][0]["problem"]  # a prompt the model was taught on
    try:
        updates = list(send(problem, "5", DEFAULT_INSTRUCTION, "", True, 0.7, 1.0, 64, []))
        assert tools.worker.proc is not None and tools.worker.restarts == 0  # the call ran in the real worker
    finally:
        tools.close()
    chat, _, reward, _, status, turns = updates[-1]
    assert status.startswith("answered in")
    assert [m.get("metadata", {}).get("title") for m in chat[:3]] == [None, "Tool call", "Tool result"]
    assert CALL in chat[1]["content"] and chat[2]["content"] == "```\n5\n```"  # add(2, 3), computed by the worker
    assert chat[3:] == assistant_messages("Done.")  # the final turn, read after the result, shown as an answer
    # the turns as the episode's messages; the answer as the rewards get it in training (the whole episode's text)
    [turn] = turns
    assert [(m["role"], m["content"]) for m in turn["checkpoint_episode"]] == [
        ("assistant", CALL), ("tool", "5"), ("assistant", "Done.")]
    assert "tool\n5" in turn["checkpoint"] and reward == "reward: accuracy 1"
    # streamed: the page was updated while the turns were written, the call shown folded before the final turn
    assert len(updates) > 5
    assert any([m.get("metadata", {}).get("title") for m in u[0]][1:3] == ["Tool call", "Tool result"]
               and len(u[0]) == 3 for u in updates)
    # the next prompt's conversation carries the episode as the template's messages
    history = model_messages(turns, "checkpoint", "And 4 more?", DEFAULT_INSTRUCTION, None)
    assert [m["role"] for m in history] == ["user", "assistant", "tool", "assistant", "user"]


def test_the_system_prompt_describes_the_tools_as_in_training(tool_caller):
    from lib.data.records import format_prompt

    args = parse_args(["--tools", f"{TOOLS}:add"])
    run = {"tools": ["lib.agents.tools:calculator"], "max_tool_calling_iterations": 3, "tool_timeout": 7.0}
    tools = page_tools(args, run)  # --tools wins over the run's tools; the run's limits stay
    assert tools.specs == [f"{TOOLS}:add"] and tools.max_iterations == 3 and tools.worker.timeout == 7.0
    limited = page_tools(parse_args(["--tools", f"{TOOLS}:add", "--max_tool_calling_iterations", "1",
                                     "--tool_timeout", "0"]), run)
    assert limited.max_iterations == 1 and limited.worker.timeout == 0.0
    slot = Slot("checkpoint")
    slot.load(tool_caller)
    agent = tools.agent(slot.tokenizer, 64)
    system, kwargs = agent.prompt_settings(None, None)
    assert system == plain_tool_prompt(tool_schemas([f"{TOOLS}:add"])) and kwargs is None
    messages = model_messages([], "checkpoint", "2 + 3?", DEFAULT_INSTRUCTION, system)
    config = type("Config", (), {"max_new_tokens": 64})
    assert slot.tokenizer.decode(slot.prompt_ids(messages, config)) == format_prompt(
        slot.tokenizer, "2 + 3?", DEFAULT_INSTRUCTION, system)
    assert page_tools(parse_args(["--tools"]), {"tools": [f"{TOOLS}:add"]}) is None  # --tools alone: none


@pytest.mark.parametrize("argv, message", [
    (["--tools", f"{TOOLS}:untyped"], "error: --tools: tool 'untyped': "),
    (["--tools", f"{TOOLS}:nope"], "error: --tools: tool 'tests/tiny_tools.py:nope': module"),
    (["--tools", "no_such_module_here:add"], "error: --tools: "),
    (["--tools", f"{TOOLS}:add", "--max_tool_calling_iterations", "-1"],
     "error: --max_tool_calling_iterations must be >= 0"),
    (["--tools", f"{TOOLS}:add", "--tool_timeout", "nan"], "error: --tool_timeout must be >= 0 seconds"),
])
def test_bad_tool_options_are_refused_before_any_model_loads(argv, message, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    # a model that does not exist: the tools are checked first, so their error is the one that stops the page
    with pytest.raises(SystemExit) as stop:
        main([*argv, "--model_name_or_path", str(tmp_path / "missing")])
    assert str(stop.value).startswith(message), stop.value
    assert "\n" not in str(stop.value)


def test_a_runs_tools_that_do_not_load_here_are_named_with_the_fix(run_with_tools, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the run's file path does not resolve from here
    with pytest.raises(SystemExit, match=r"error: the run's config.yaml 'tools': .*; pass --tools with tools that "
                                         r"load here, or --tools alone to chat without tools"):
        main(["--model_name_or_path", str(run_with_tools / "final")])


def test_a_saved_episode_loads_back_and_a_malformed_one_is_refused(tmp_path):
    import json

    from lib.apps.page import PageInputError, chat_view

    episode = [{"role": "assistant", "content": CALL}, {"role": "tool", "content": "5"},
               {"role": "assistant", "content": "Done."}]
    path = tmp_path / "conversation.json"
    path.write_text(json.dumps({"format": "agrpo-chat/1", "turns": [
        {"prompt": "2 + 3?", "checkpoint": "...", "checkpoint_episode": episode}]}))
    data = read_conversation(str(path))
    assert [m.get("metadata", {}).get("title") for m in chat_view(data["turns"], "checkpoint")][:3] == [
        None, "Tool call", "Tool result"]
    path.write_text(json.dumps({"format": "agrpo-chat/1", "turns": [
        {"prompt": "2 + 3?", "base_episode": [{"role": "user", "content": "hi"}]}]}))
    with pytest.raises(PageInputError, match="turn 1: 'base_episode' must be a list of"):
        read_conversation(str(path))


def test_without_tools_the_same_model_answers_in_one_streamed_turn(tool_caller, tmp_path):
    """The page without tools (--tools alone): the call the model writes is its answer, nothing runs."""
    args = parse_args(["--tools", "--reward_funcs", "accuracy"])
    assert page_tools(args, {"tools": [f"{TOOLS}:add"]}) is None
    checkpoint = Slot("checkpoint")
    checkpoint.load(tool_caller)
    app = build_app(checkpoint, Slot("base"), args, None, {})
    send = {d.api_name: d.fn for d in app.fns.values() if d.api_name}["send"]
    problem = builtin_task(seed=0, num_train=4, num_eval=0)[0][0]["problem"]
    # the system prompt the model was taught with, typed in the page: it writes the call, and the answer ends there
    system = plain_tool_prompt(tool_schemas([f"{TOOLS}:add"]))
    updates = list(send(problem, "", DEFAULT_INSTRUCTION, system, True, 0.7, 1.0, 64, []))
    chat, *_, status, turns = updates[-1]
    assert status.startswith("answered in") and len(updates) > 5  # token by token
    assert turns[0]["checkpoint"] == CALL and "checkpoint_episode" not in turns[0]
    assert all("Tool" not in str(m.get("metadata", {}).get("title")) for m in chat)


def children(pid: int) -> set[int]:
    """The child processes of `pid` (Linux /proc)."""
    from pathlib import Path

    found = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        found |= {int(c) for c in (task / "children").read_text().split()}
    return found


@pytest.mark.slow  # the page started as a user starts it, on the taught model: 23 s on 2 shared CPU cores
def test_the_page_started_on_a_run_with_tools_answers_with_episodes_and_stops_its_worker(run_with_tools, tmp_path):
    import os
    import signal
    import time

    from gradio_client import Client

    from conftest import start_page, wait_for_page

    log = tmp_path / "page.log"
    proc, port = start_page(["--model_name_or_path", str(run_with_tools / "final"), "--max_new_tokens", "64"], REPO,
                            log)
    try:
        client = Client(wait_for_page(proc, port, log, timeout_s=300), verbose=False)
        problem = builtin_task(seed=0, num_train=4, num_eval=0)[0][0]["problem"]
        chat_a, chat_b, reward_a, reward_b, status = client.predict(problem, "5", DEFAULT_INSTRUCTION, "", True, 0.7,
                                                                    1.0, 64, api_name="/send")
        assert status.startswith("answered in")
        # both sides (the checkpoint, and the run's starting model as its base) ran episodes with the run's tool
        for chat in (chat_a, chat_b):
            assert [(m.get("metadata") or {}).get("title") for m in chat[1:3]] == ["Tool call", "Tool result"]
            content = chat[2]["content"]  # the client's form: a list of text parts
            assert [part["text"] for part in content] == ["```\n5\n```"]
        assert "Answers are episodes with tools: add (turns with calls: at most 2" in log.read_text()
        workers = children(proc.pid)
        assert workers  # the page's tool worker
        client.close()  # its heartbeat connection
    finally:
        # stopped as tests/test_chat_app.py stops the page (SIGTERM): a suite started as a background job inherits
        # SIGINT ignored, and then Python never raises KeyboardInterrupt; the worker must not outlive the page
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    deadline = time.time() + 10
    while time.time() < deadline and any(os.path.exists(f"/proc/{w}") for w in workers):
        time.sleep(0.2)
    assert not any(os.path.exists(f"/proc/{w}") for w in workers), "the tool worker outlived the page"


def test_the_iteration_limit_and_the_budget_end_an_answer_as_they_end_an_episode(tool_caller):
    """--max_tool_calling_iterations 0: the call is written but not run (section 3's rule); a max new tokens the
    call does not fit in: the episode ends cut, nothing run."""
    checkpoint = Slot("checkpoint")
    checkpoint.load(tool_caller)
    problem = builtin_task(seed=0, num_train=4, num_eval=0)[0][0]["problem"]
    for argv, max_new_tokens, expected in ((["--max_tool_calling_iterations", "0"], 64, CALL),
                                           ([], 8, None)):
        args = parse_args(["--tools", f"{TOOLS}:add", *argv, "--reward_funcs", "accuracy"])
        tools = page_tools(args, {})
        send = {d.api_name: d.fn for d in build_app(checkpoint, Slot("base"), args, None, {}, tools=tools)
                .fns.values() if d.api_name}["send"]
        try:
            *_, turns = list(send(problem, "", DEFAULT_INSTRUCTION, "", True, 0.7, 1.0, max_new_tokens, []))[-1]
            assert tools.worker.proc is None  # no call ran: the worker never started
        finally:
            tools.close()
        [message] = turns[0]["checkpoint_episode"]
        assert message["role"] == "assistant"
        if expected:
            assert message["content"] == expected
        else:
            assert CALL.startswith(message["content"]) and len(message["content"]) < len(CALL)
