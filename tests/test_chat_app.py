"""chat_app.py: the pure helpers, then the real page on the embedded model driven by gradio_client and by headless
Chromium (Playwright)."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import REPO, start_page, wait_for_page

sys.path.insert(0, str(REPO))
from lib.apps.page import (MAX_UPLOAD_BYTES, PageInputError, allowed_roots, check_inside,  # noqa: E402
                             checkpoint_choices, exposure, generation_config, loadable, model_messages,
                             read_conversation, run_folder_of, split_reasoning)
from chat_app import main, parse_args  # noqa: E402
from test_reward_models import own_forward, tiny_reward_model  # noqa: E402,F401  (a fixture)


@pytest.mark.parametrize("text, expected", [
    ("Mia has 2 + 13 = 15 marbles.\nAnswer: 15", ("Mia has 2 + 13 = 15 marbles.", "15")),
    ("So the total is 5. **Answer:** 5", ("So the total is 5.", "5")),
    ("<think>\nadd them\n</think>\n<answer>\n5\n</answer>", ("add them", "5")),
    ("<think>add</think> 7", ("add", "7")),
    ("The train leaves at\nAnswer: 3:30", ("The train leaves at", "3:30")),
    ("She has 7 apples left.", ("She has 7 apples left.", "7")),  # no marker: the last number
    ("I am not sure.", ("I am not sure.", "")),
])
def test_split_reasoning(text, expected):
    assert split_reasoning(text) == expected


def test_model_messages_carry_each_sides_own_history_and_the_instruction():
    turns = [{"prompt": "2 + 2?", "checkpoint": "Answer: 4", "base": "Answer: 5"}]
    messages = model_messages(turns, "base", "3 + 3?", "Give the answer.", "Be brief.")
    assert messages == [{"role": "system", "content": "Be brief."},
                        {"role": "user", "content": "2 + 2?\nGive the answer."},
                        {"role": "assistant", "content": "Answer: 5"},
                        {"role": "user", "content": "3 + 3?\nGive the answer."}]


def test_checkpoint_choices_list_final_then_newest_checkpoints(tmp_path):
    for step in (5, 10, 20):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    (tmp_path / "checkpoint-30").mkdir()  # no trainer_state.json: an interrupted save, not listed
    (tmp_path / "final").mkdir()
    (tmp_path / "config.yaml").write_text("model_name_or_path: embedded\n")
    assert checkpoint_choices(str(tmp_path)) == ["final", "checkpoint-20", "checkpoint-10", "checkpoint-5"]
    assert run_folder_of(str(tmp_path / "final")) == tmp_path


def test_generation_config_greedy_sampling_and_bad_values():
    greedy = generation_config(True, 0.7, 0.9, 64, [2], 2)
    assert greedy.do_sample is False and greedy.max_new_tokens == 64
    sampled = generation_config(False, 0.7, 0.9, 64, [2], 2)
    assert sampled.do_sample and sampled.temperature == 0.7 and sampled.top_p == 0.9
    with pytest.raises(ValueError):
        generation_config(False, -1.0, 0.9, 64, [2], 2)


# ---------------------------------------------------------------------------------------------- exposure and paths


@pytest.mark.parametrize("argv, refused", [
    ([], False), (["--host", "localhost"], False),
    (["--host", "0.0.0.0"], True), (["--share"], True), (["--host", "192.168.1.5"], True),
    (["--host", "0.0.0.0", "--auth", "ana:s3cret-pw"], False), (["--share", "--no_auth_i_know"], False),
])
def test_binding_beyond_this_machine_needs_a_login_or_the_explicit_flag(argv, refused, monkeypatch):
    monkeypatch.delenv("AGRPO_CHAT_AUTH", raising=False)
    if refused:
        with pytest.raises(SystemExit, match="would be open to other machines without a login.*--auth USER:PASSWORD "
                                             "\\(or set AGRPO_CHAT_AUTH=USER:PASSWORD\\), or --no_auth_i_know"):
            exposure(parse_args(argv))
    else:
        exposure(parse_args(argv))
    monkeypatch.setenv("AGRPO_CHAT_AUTH", "ana:from-the-env")
    assert exposure(parse_args(["--host", "0.0.0.0"])) == ("ana", "from-the-env")


@pytest.mark.parametrize("auth", ["nopassword", ":pw", "ana:"])
def test_a_malformed_login_is_refused_without_echoing_it(auth, monkeypatch):
    monkeypatch.delenv("AGRPO_CHAT_AUTH", raising=False)
    with pytest.raises(SystemExit) as stop:
        exposure(parse_args(["--host", "0.0.0.0", "--auth", auth]))
    assert "expected USER:PASSWORD" in str(stop.value) and (auth not in str(stop.value) or auth == "ana:")
    monkeypatch.setenv("AGRPO_CHAT_AUTH", "secret-without-colon")
    with pytest.raises(SystemExit, match="\\$AGRPO_CHAT_AUTH: expected USER:PASSWORD") as stop:
        exposure(parse_args(["--share"]))
    assert "secret-without-colon" not in str(stop.value)


def test_typed_paths_cannot_leave_the_folders_the_page_started_with(tmp_path):
    run = tmp_path / "runs" / "agrpo"
    (run / "final").mkdir(parents=True)
    (run / "config.yaml").write_text("model_name_or_path: embedded\n")
    outside = tmp_path / "elsewhere"
    (outside / "model").mkdir(parents=True)
    (run / "link").symlink_to(outside)  # a symlink inside the run folder that points out of it
    roots = allowed_roots(parse_args([]), str(run / "final"), "embedded", run)
    assert roots == [run.resolve(), (run / "final").resolve()]
    assert check_inside(str(run / "final"), roots, "x") == (run / "final").resolve()
    assert loadable(str(run / "checkpoint-9"), roots, set()) == str((run / "checkpoint-9").resolve())
    assert loadable("embedded", roots, set()) == "embedded"
    assert loadable("some/hub-id", roots, {"some/hub-id"}) == "some/hub-id"  # named at start: allowed again
    for typed in (str(outside / "model"), str(run / ".." / ".." / "elsewhere" / "model"), str(run / "link" / "model"),
                  "/", "~", "other/hub-id"):
        with pytest.raises(PageInputError, match="is outside the folders this page may open"):
            loadable(typed, roots, set())
    with pytest.raises(PageInputError, match="is not a usable path"):
        check_inside("a\x00b", roots, "the run folder")
    extra = allowed_roots(parse_args(["--allow_dir", str(outside)]), "embedded", "embedded", None)
    assert extra == [outside.resolve()]


def conversation(tmp_path, content) -> str:
    path = tmp_path / "conversation.json"
    path.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
    return str(path)


@pytest.mark.parametrize("content, message", [
    (b"{not json", "the file is not valid JSON (Expecting property name enclosed in double quotes at line 1, column 2)"),
    (b"\xff\xfe{}", "the file is not UTF-8 text (byte 0)"),
    (b"[" * 100_000, "the file is not valid JSON (nested too deeply)"),
    ([1, 2], "not a conversation saved by this page"),
    ({"format": "agrpo-chat/1", "turns": [{"prompt": 3}]}, "turn 1 has no prompt text"),
    ({"format": "agrpo-chat/1", "turns": [{"prompt": "hi", "base": {"a": 1}}]}, "turn 1: 'base' must be text"),
    ({"format": "agrpo-chat/1", "turns": "x"}, "not a conversation saved by this page"),
])
def test_a_bad_conversation_upload_gets_a_message(content, message, tmp_path):
    with pytest.raises(PageInputError) as error:
        read_conversation(conversation(tmp_path, content))
    assert message in str(error.value)


def test_a_huge_upload_is_refused_and_odd_settings_fall_back(tmp_path):
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(MAX_UPLOAD_BYTES + 1)
    with pytest.raises(PageInputError, match="the file is 10.0 MB; a saved conversation is under 10 MB"):
        read_conversation(str(big))
    data = read_conversation(conversation(tmp_path, {
        "format": "agrpo-chat/1", "instruction": 7, "turns": [{"prompt": "hi", "checkpoint": "4", "streaming": True}],
        "settings": {"greedy": "yes", "temperature": float("nan"), "top_p": 5, "max_new_tokens": 100.0}}))
    assert data["turns"] == [{"prompt": "hi", "checkpoint": "4"}]
    assert data["settings"] == {"greedy": True, "temperature": 0.7, "top_p": 1.0, "max_new_tokens": 100}
    assert isinstance(data["instruction"], str)


def page_events(tmp_path):
    """The page built on two empty slots (no model loads), and its event functions by api name."""
    from chat_app import Slot, build_app

    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    app = build_app(Slot("checkpoint"), Slot("base"), parse_args(["--reward_funcs", "accuracy"]), run, {})
    return run, {d.api_name: d.fn for d in app.fns.values() if d.api_name}


def test_the_page_refuses_folders_outside_its_roots_and_bad_uploads_in_its_status_line(tmp_path):
    run, events = page_events(tmp_path)
    picker, status = events["list_checkpoints"](str(tmp_path))
    assert "is outside the folders this page may open" in status
    picker, status = events["list_checkpoints"](str(run))
    assert status == f"1 model folder(s) in {run}"
    status, _ = events["load_checkpoint"](str(run), str(tmp_path / "other"), "")
    assert "the model folder" in status and "is outside the folders this page may open" in status
    status, _ = events["load_checkpoint"](str(tmp_path), "final", "")
    assert "the run folder" in status and "is outside" in status
    status, _ = events["load_checkpoint"](str(run), "", "/etc")
    assert "is outside the folders this page may open" in status
    bad = tmp_path / "bad.json"
    bad.write_bytes(b"\xff")
    *_, status, turns = events["load_conversation"](str(bad), [])
    assert status.startswith("could not load the conversation: the file is not UTF-8 text") and turns == []


def test_host_without_login_exits_with_one_line_before_loading_anything(tmp_path, monkeypatch, capsys):
    """chat_app.main in this process: its SystemExit is the one line the interpreter prints, exit status 1
    (tests/test_chat_address.py runs the same refusal from the command line)."""
    monkeypatch.delenv("AGRPO_CHAT_AUTH", raising=False)
    monkeypatch.delenv("GRADIO_SERVER_NAME", raising=False)
    with pytest.raises(SystemExit) as stopped:
        main(["--host", "0.0.0.0", "--model_name_or_path", str(tmp_path / "missing")])
    message = stopped.value.code
    assert isinstance(message, str)  # printed to stderr with exit status 1
    assert message.startswith("error: --host 0.0.0.0: the page would be open to other machines")
    assert len(message.splitlines()) == 1  # checked before the model argument, before any load
    assert capsys.readouterr() == ("", "")


def test_the_page_scores_with_a_reward_model_given_in_reward_funcs(tiny_model, tiny_reward_model):
    """--reward_funcs takes what the trainer's reward_funcs takes: a reward model's folder beside a built-in is loaded
    by the trainer's and the evaluator's builder (lib/models/reward_models.build_rewards) and scores each answer
    against the reference as in training: the model's own forward on the turn's prompt (the instruction after it) and
    the answer, in its chat template. A spec that is neither is refused before any model loads."""
    from chat_app import Slot, build_app
    from lib.models.reward_models import load_reward_model

    args = parse_args(["--reward_funcs", "accuracy", tiny_reward_model])
    checkpoint = Slot("checkpoint")
    checkpoint.load(tiny_model)
    app = build_app(checkpoint, Slot("base"), args, None, {})
    send = {d.api_name: d.fn for d in app.fns.values() if d.api_name}["send"]
    instruction = "Give the final answer as 'Answer: <number>'."
    *_, reward_line, _, status, turns = list(send("What is 2 + 2?", "4", instruction, "", True, 0.7, 1.0, 8, []))[-1]
    assert status.startswith("answered in")
    rewards = turns[0]["rewards"]["checkpoint"]
    assert list(rewards) == ["accuracy", "tiny_rm"] and "tiny_rm" in reward_line
    model = load_reward_model(tiny_reward_model, "cpu")
    text = model.text([{"role": "user", "content": f"What is 2 + 2?\n{instruction}"}], turns[0]["checkpoint"])
    assert rewards["tiny_rm"] == pytest.approx(own_forward(model.model, model.tokenizer, text), abs=1e-5)
    with pytest.raises(SystemExit, match="error: --reward_funcs: .*'./no_such_rm'.*no such folder"):
        main(["--reward_funcs", "accuracy", "./no_such_rm"])



def test_the_builtin_rewards_score_as_the_run_trained_them(tiny_model):
    """The page's cosine and soft_overlong rewards take the options the run trained with (its config.yaml's
    cosine_max_len, max_completion_length, overlong_buffer_length), the trainer's defaults without a run, and count
    the answer's tokens as the trainer's completion_length does (they once got the functions' own defaults and no
    token count: soft_overlong then failed on every answer)."""
    from chat_app import Slot, build_app
    from lib.apps.page import reward_options_of
    from lib.config import FIELDS, default_of
    from lib.rewards.open_r1 import cosine_reward, soft_overlong_reward

    checkpoint = Slot("checkpoint")
    checkpoint.load(tiny_model)
    run = {"cosine_max_len": 4, "max_completion_length": 8, "overlong_buffer_length": 2}
    app = build_app(checkpoint, Slot("base"), parse_args(["--reward_funcs", "cosine", "soft_overlong"]), None, run)
    send = {d.api_name: d.fn for d in app.fns.values() if d.api_name}["send"]
    *_, status, turns = list(send("What is 2 + 2?", "4", "", "", True, 0.7, 1.0, 8, []))[-1]
    assert status.startswith("answered in"), status
    text, length = turns[0]["checkpoint"], [turns[0]["tokens"]["checkpoint"]]
    assert 0 < length[0] <= 8
    assert turns[0]["rewards"]["checkpoint"] == {
        "cosine": cosine_reward([""], [text], ["4"], length, max_len=4)[0],
        "soft_overlong": soft_overlong_reward([""], [text], length, max_completion_length=8,
                                              overlong_buffer_length=2)[0]}
    # without a run, the trainer's defaults: cosine's length and the buffer from its max_completion_length
    default = default_of(FIELDS["max_completion_length"])
    assert reward_options_of({}) == {"max_len": default, "max_completion_length": default,
                                     "overlong_buffer_length": max(1, default // 5), "ngram_size": 3,
                                     "max_penalty": -1.0}
    assert reward_options_of(run)["max_len"] == 4 and reward_options_of(run)["overlong_buffer_length"] == 2

# ---------------------------------------------------------------------------------------------- the real page


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory, trained_like):
    """A run folder as the trainer leaves it: config.yaml, final/ (a full model whose weights moved) and
    checkpoint-2/ (a LoRA adapter on the embedded model), and a folder that is not a model."""
    run = tmp_path_factory.mktemp("run")
    (run / "config.yaml").write_text("model_name_or_path: embedded:SmolLM2-135M-Instruct\n"
                                     "instruction: \"Give the final answer as 'Answer: <number>'.\"\n")
    shutil.copytree(trained_like / "full", run / "final")
    shutil.copytree(trained_like / "lora", run / "checkpoint-2")
    (run / "checkpoint-2" / "trainer_state.json").write_text("{}")
    (run / "not_a_model").mkdir()
    return run


@pytest.fixture(scope="module")
def page_tmp(tmp_path_factory):
    """The page's temporary folder (TMPDIR)."""
    return tmp_path_factory.mktemp("page_tmp")


@pytest.fixture(scope="module")
def page(run_folder, tmp_path_factory, page_tmp):
    """The app started as a user starts it, on a free port; yields its URL. Stopped with SIGTERM, as a service
    manager stops it, it closes as Ctrl-C closes it, and takes the files its Save and Export buttons wrote with it."""
    log = tmp_path_factory.mktemp("log") / "app.log"
    proc, port = start_page(["--model_name_or_path", str(run_folder / "final"), "--max_new_tokens", "48"],
                            run_folder, log, env={"TMPDIR": str(page_tmp)})
    url = wait_for_page(proc, port, log, timeout_s=300)
    yield url
    proc.terminate()
    assert proc.wait(timeout=30) == 0, log.read_text()[-3000:]
    assert not list(page_tmp.glob("agrpo-chat-*")), sorted(page_tmp.iterdir())


def ask(client, prompt, reference="", greedy=True, max_new_tokens=48):
    instruction = "Give the final answer as 'Answer: <number>'."
    return client.predict(prompt, reference, instruction, "", greedy, 0.7, 1.0, max_new_tokens, api_name="/send")


@pytest.mark.slow
def test_client_sends_a_prompt_gets_both_answers_and_switches_checkpoint(page, run_folder, page_tmp, tmp_path,
                                                                          monkeypatch):
    from gradio_client import Client

    # the client's downloads, and the folder it passes each one through (gradio_client leaves that one behind),
    # in this test's folder rather than /tmp
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    client = Client(page, verbose=False, download_files=tmp_path / "downloads")
    chat_a, chat_b, reward_a, reward_b, status = ask(client, "Ana has 3 apples and gets 4 more. How many now?", "7")
    assert status.startswith("answered in")
    for chat in (chat_a, chat_b):
        assert chat[0]["role"] == "user" and "Ana has 3 apples" in str(chat[0]["content"])
        assert any(m["role"] == "assistant" for m in chat)
    assert reward_a.startswith("reward: accuracy") and reward_b.startswith("reward: accuracy")
    # the list of the run's models, then a switch to the LoRA checkpoint without a restart
    picker, status = client.predict(str(run_folder), api_name="/list_checkpoints")
    assert "2 model folder(s)" in status
    status, heading = client.predict(str(run_folder), "checkpoint-2", "embedded", api_name="/load_checkpoint")
    assert "checkpoint: loaded" in status and "checkpoint-2" in heading
    # the second turn follows the first, and arrives in many partial updates (streamed token by token)
    instruction = "Give the final answer as 'Answer: <number>'."
    job = client.submit("What is 5 + 6?", "", instruction, "", True, 0.7, 1.0, 48, api_name="/send")
    chat_a, chat_b, *_ = job.result(timeout=300)
    assert len(chat_a) > 2 and len(chat_b) > 2
    assert len(job.outputs()) > 10
    # bad input is a message in the page
    *_, status = ask(client, "   ")
    assert status == "Type a prompt first: the prompt is empty."
    status, _ = client.predict(str(run_folder), str(run_folder / "not_a_model"), "embedded",
                               api_name="/load_checkpoint")
    assert "is not a model folder" in status
    status, _ = client.predict(str(run_folder), str(run_folder), "embedded", api_name="/load_checkpoint")
    assert "it is a run folder: pass its final/" in status
    orphan = run_folder / "orphan_adapter"
    shutil.copytree(run_folder / "checkpoint-2", orphan, dirs_exist_ok=True)
    config = json.loads((orphan / "adapter_config.json").read_text())
    (orphan / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "./gone/base"}))
    status, heading = client.predict(str(run_folder), str(orphan), "embedded", api_name="/load_checkpoint")
    assert "is for the base model './gone/base', which does not exist here" in status
    assert "checkpoint-2" in heading  # the model loaded before is still the one answering
    *_, status = ask(client, "word " * 9000, max_new_tokens=64)
    assert "more than the model's context of 8192" in status
    # the last good turn is intact after the bad inputs: export settings and save the conversation
    path, status = client.predict(False, 0.8, 0.95, 100, api_name="/export_generation_config")
    config = json.loads(Path(path).read_text())
    assert config["do_sample"] is True and config["temperature"] == 0.8 and config["max_new_tokens"] == 100
    path, status = client.predict(api_name="/save_conversation")
    saved = json.loads(Path(path).read_text())
    # the page wrote both files in one folder of its own (removed when it stops: the `page` fixture)
    written = sorted(p.name for p in page_tmp.glob("agrpo-chat-*/*/*.json"))
    assert written == ["conversation.json", "generation_config.json"], written
    assert saved["format"] == "agrpo-chat/1" and len(saved["turns"]) == 2
    assert saved["turns"][0]["reference"] == "7" and "accuracy" in saved["turns"][0]["rewards"]["checkpoint"]
    # clear, then load the saved conversation back: both sides and the settings return
    chat_a, chat_b, *_ = client.predict(api_name="/clear")
    assert chat_a == [] and chat_b == []
    from gradio_client import handle_file

    chat_a, chat_b, greedy, temperature, top_p, max_new, instruction, status = client.predict(
        handle_file(path), api_name="/load_conversation")
    assert status == "loaded 2 turn(s)" and greedy is True and max_new == 48
    prompts = [str(m["content"]) for m in chat_a if m["role"] == "user"]
    assert len(prompts) == 2 and all(t["prompt"] in shown for t, shown in zip(saved["turns"], prompts))
    assert any("Final answer" in str(m["content"]) or "no final answer" in str(m["content"]) for m in chat_b)
    bad = Path(path).with_name("not_a_conversation.json")
    bad.write_text('{"turns": 3}')
    *_, status = client.predict(handle_file(str(bad)), api_name="/load_conversation")
    assert status.startswith("could not load the conversation: not a conversation saved by this page")


@pytest.mark.slow
def test_adapter_whose_base_is_missing_is_named_at_start(run_folder, tmp_path):
    adapter = tmp_path / "adapter"
    shutil.copytree(run_folder / "checkpoint-2", adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(tmp_path / "gone")
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    proc = subprocess.run([sys.executable, str(REPO / "chat_app.py"), "--model_name_or_path", str(adapter)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "is for the base model" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
@pytest.mark.browser
def test_browser_types_a_prompt_and_sees_both_answers(page, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("Debian's chromium is not installed (.ci/run installs it)")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        view = browser.new_page(viewport={"width": 1280, "height": 900})
        view.goto(page)
        view.locator("#prompt textarea").fill("Ben has 9 marbles and loses 4. How many are left?")
        view.locator("#reference textarea").fill("5")
        view.locator("#send").click()
        view.wait_for_function("document.querySelector('#status').innerText.includes('answered in')",
                               timeout=240_000)
        for side in ("#chat-checkpoint", "#chat-base"):
            text = view.locator(side).inner_text()
            assert "Ben has 9 marbles" in text and ("Final answer" in text or "no final answer" in text)
        assert "reward: accuracy" in view.locator("#reward-checkpoint").inner_text()
        shot = Path(os.environ.get("AGRPO_SCREENSHOT", tmp_path / "chat_app.png"))
        view.screenshot(path=str(shot), full_page=True)
        browser.close()
    assert shot.stat().st_size > 20_000
