"""push_to_hub, the model card and generation_config.json (lib/hub.py, docs/hub.md), offline.

The uploads go to a small local HTTP server (`FakeHub`) that implements the endpoints huggingface_hub 2.4's
`whoami`, `create_repo`, `create_branch` and `create_commit` call, with HF_ENDPOINT (or huggingface_hub's ENDPOINT
in this process) pointed at it; it answers "regular" to every file, so the LFS / Xet upload of large weights is the
one path these tests do not run (docs/hub.md 5). The trainer runs as a user runs it (a subprocess) on the tiny
random model of tests/conftest.py."""

import base64
import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from conftest import REPO, wait_until
from lib import hub
from lib.config import ConfigError, make_config, to_dict

TOKEN = "hf_test_secret_never_written"
REWARDS = str(REPO / "tests" / "tiny_rewards.py")
TINY = ["--per_device_train_batch_size", "8", "--num_generations", "4", "--max_completion_length", "8",
        "--num_eval_samples", "4", "--builtin_num_train", "64", "--learning_rate", "1e-3", "--reward_funcs",
        f"{REWARDS}:has_x", f"{REWARDS}:characters", "--reward_weights", "1", "0.5", "--correctness_reward", "has_x",
        "--bf16", "false"]


# ---- a hub on this machine ------------------------------------------------------------------------------------------

class FakeHub:
    """The hub's endpoints that push_to_hub calls, recording what arrives. `role` is the token's role whoami
    reports; `fail_commits` answers 500 to every commit."""

    def __init__(self, token: str = TOKEN, role: str = "write", fail_commits: bool = False):
        self.token, self.role, self.fail_commits = token, role, fail_commits
        self.requests: list[tuple[str, str]] = []  # (method, path)
        self.auth: set[str] = set()  # every Authorization header of an API call (all but the agent registry)
        self.created: list[dict] = []  # create_repo payloads
        self.branches: list[str] = []
        self.commits: list[dict] = []  # {"revision", "message", "files": {path: bytes}}
        self.validated: list[str] = []  # README.md texts sent to validate-yaml
        hub_state = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def reply(self, status: int, body: dict):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                hub_state.requests.append(("GET", self.path))
                if self.path != "/api/agent-harnesses":  # huggingface_hub's user agent: asked without a token
                    hub_state.auth.add(self.headers.get("Authorization", ""))
                if self.path == "/api/whoami-v2":
                    if self.headers.get("Authorization") != f"Bearer {hub_state.token}":
                        return self.reply(401, {"error": "Invalid credentials in Authorization header"})
                    return self.reply(200, {"name": "tester", "auth": {"accessToken": {"role": hub_state.role}}})
                self.reply(404, {"error": "not implemented by the fake hub"})

            def do_POST(self):
                hub_state.requests.append(("POST", self.path))
                hub_state.auth.add(self.headers.get("Authorization", ""))
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                path = self.path.split("?")[0]
                if path == "/api/repos/create":
                    payload = json.loads(body)
                    hub_state.created.append(payload)
                    return self.reply(200, {"url": f"{hub_state.url}/{payload['organization']}/{payload['name']}"})
                if path == "/api/validate-yaml":
                    hub_state.validated.append(json.loads(body)["content"])
                    return self.reply(200, {"errors": [], "warnings": []})
                parts = path.split("/")  # /api/models/<ns>/<name>/<action>/<revision>
                if len(parts) == 7 and parts[1:3] == ["api", "models"]:
                    action, revision = parts[5], parts[6]
                    if action == "branch":
                        hub_state.branches.append(revision)
                        return self.reply(200, {})
                    if action == "preupload":
                        files = json.loads(body)["files"]
                        return self.reply(200, {"files": [{"path": f["path"], "uploadMode": "regular",
                                                           "shouldIgnore": False, "oid": None} for f in files]})
                    if action == "commit":
                        if hub_state.fail_commits:
                            return self.reply(500, {"error": "the fake hub is down"})
                        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
                        header = next(x["value"] for x in lines if x["key"] == "header")
                        files = {x["value"]["path"]: base64.b64decode(x["value"]["content"])
                                 for x in lines if x["key"] == "file"}
                        hub_state.commits.append({"revision": revision, "message": header["summary"],
                                                  "files": files, "keys": {x["key"] for x in lines}})
                        return self.reply(200, {"commitUrl": f"{hub_state.url}/{parts[3]}/{parts[4]}/commit/0",
                                                "commitOid": "0" * 40})
                self.reply(404, {"error": "not implemented by the fake hub"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_hub():
    server = FakeHub()
    yield server
    server.close()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again: nothing listens there


SILENT_SOCKETS = []  # open until the process exits: a call left waiting on one stays quiet instead of retrying


@pytest.fixture(scope="session")
def silent_hub():
    """A port that accepts connections and never answers (the kernel completes them into the backlog)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    SILENT_SOCKETS.append(s)
    return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def online(monkeypatch, tmp_path):
    """huggingface_hub online, with no token of this machine's (the token file moved to an empty folder)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no_token"))
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(name, raising=False)
    return constants


def hub_env(endpoint: str, tmp_path: Path, token: str | None = TOKEN) -> dict:
    """The trainer's environment: online, the hub at `endpoint`, the token in HF_TOKEN (or none), and no token file
    of this machine's (HF_TOKEN_PATH in an empty folder)."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN",
                                                            "HUGGING_FACE_HUB_TOKEN")}
    env.update(HF_ENDPOINT=endpoint, HF_TOKEN_PATH=str(tmp_path / "no_token"), TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1")
    if token:
        env["HF_TOKEN"] = token
    return env


def train(args: list[str], cwd: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "train_agrpo.py"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def files_under(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ---- the model card and generation_config.json (pure) ---------------------------------------------------------------

def card(**overrides) -> str:
    args = dict(name="qwen-grpo", base_label="`Qwen/Qwen2.5-0.5B-Instruct`", base_model_id="Qwen/Qwen2.5-0.5B-Instruct",
                adapter=False, algo="agrpo", data="the hub data set `openai/gsm8k`, configuration `main`, split "
                "`train`", dataset_id="openai/gsm8k", changed={"beta": 0.001, "reward_funcs": ["accuracy", "format"]},
                before={"eval/accuracy": 0.225, "eval/mean_length": 33.1, "eval/num_problems": 200.0},
                after={"eval/accuracy": 0.56, "eval/mean_length": 24.8, "eval/num_problems": 200.0}, steps=40,
                command="python train_agrpo.py --algo agrpo", exact=True, usage_id="tester/qwen-grpo")
    return hub.model_card(**{**args, **overrides})


def front_matter(text: str) -> dict:
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


def test_the_model_card_has_the_hubs_front_matter_and_what_produced_the_model():
    text = card()
    assert front_matter(text) == {"library_name": "transformers", "base_model": "Qwen/Qwen2.5-0.5B-Instruct",
                                  "tags": ["agrpo", "grpo", "reinforcement-learning"], "datasets": ["openai/gsm8k"],
                                  "pipeline_tag": "text-generation"}
    assert "# qwen-grpo\n" in text and "A-GRPO" in text and "(`--algo agrpo`) for 40 optimizer steps" in text
    assert "- **Data:** the hub data set `openai/gsm8k`, configuration `main`, split `train`" in text
    assert "| `beta` | `0.001` |" in text and '| `reward_funcs` | `["accuracy", "format"]` |' in text
    assert "Greedy decoding on 200 held-out problems, before training and after step 40:" in text
    assert "| greedy accuracy | 22.5% | 56.0% |" in text and "| mean completion length, tokens | 33.1 | 24.8 |" in text
    assert "completions cut" not in text  # not measured on either side: no row
    assert "The command that produced this model:\n\n```bash\npython train_agrpo.py --algo agrpo\n```" in text
    assert 'AutoModelForCausalLM.from_pretrained("tester/qwen-grpo")' in text


def test_the_card_of_an_adapter_on_a_local_model_names_no_path_and_no_results_it_lacks():
    text = card(adapter=True, algo="grpo", base_label="a local model folder, `base`", base_model_id=None,
                dataset_id=None, before=None, after=None, changed={}, exact=False)
    meta = front_matter(text)
    assert meta["library_name"] == "peft" and "base_model" not in meta and "datasets" not in meta
    assert meta["tags"] == ["agrpo", "grpo", "reinforcement-learning", "lora"]
    assert "| setting | value |" not in text and "The run evaluated no held-out problems" in text
    assert "An equivalent command (the run was started from Python" in text
    assert "AutoPeftModelForCausalLM.from_pretrained" in text


def test_the_command_line_is_exact_from_the_script_and_never_shows_the_token():
    argv = ["/somewhere/train_agrpo.py", "--hub_token", TOKEN, "--output_dir", "runs/x", f"--hub_token={TOKEN}"]
    command, exact = hub.command_line(argv, 1, {})
    assert exact and command == "python train_agrpo.py --hub_token '***' --output_dir runs/x '--hub_token=***'"
    command, _ = hub.command_line(argv[:3], 2, {})
    assert command == "accelerate launch --num_processes 2 train_agrpo.py --hub_token '***'"
    # started from Python: rebuilt from the keys that differ, said to be equivalent
    command, exact = hub.command_line(["-m", "pytest"], 1, {"use_peft": True, "reward_funcs": ["accuracy", "format"],
                                                            "generation_kwargs": {"top_k": 5}, "eval_steps": None})
    assert not exact
    assert command == ("python train_agrpo.py --use_peft true --reward_funcs accuracy format --generation_kwargs "
                       "'{\"top_k\": 5}' --eval_steps null")
    assert TOKEN not in json.dumps(hub.changed_settings({"hub_token": TOKEN, "beta": 0.1}, {"beta": 0.04}))


def test_the_embedded_model_is_named_by_its_upstream_hub_id():
    from lib.models.embedded import EMBEDDED_ALIASES

    assert set(hub.EMBEDDED_ALIASES) == set(EMBEDDED_ALIASES)  # lib/hub.py keeps its own copy (import order)
    assert hub.base_model_label("embedded").startswith("`HuggingFaceTB/SmolLM2-135M-Instruct` (agrpo's embedded")
    assert hub.hub_id("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    assert hub.hub_id("./models/base") is None and hub.hub_id("data/train.jsonl") is None


def test_generation_values_are_the_sampling_the_run_trained_with():
    values = hub.generation_values([2, 7], temperature=0.7, top_p=0.95, top_k=0, min_p=None, repetition_penalty=1.0,
                                   max_new_tokens=64)
    # top_k 0 is written: left unset, transformers' generate would sample with top_k 50
    assert values == {"do_sample": True, "temperature": 0.7, "top_p": 0.95, "top_k": 0, "eos_token_id": [2, 7],
                      "max_new_tokens": 64}
    values = hub.generation_values([2], temperature=1.0, top_p=1.0, top_k=20, min_p=0.05, repetition_penalty=1.1,
                                   max_new_tokens=8)
    assert (values["eos_token_id"], values["min_p"], values["repetition_penalty"]) == (2, 0.05, 1.1)


# ---- what each hub_strategy pushes (pure) ---------------------------------------------------------------------------

CHECKPOINT = ["config.json", "model.safetensors", "optimizer.pt", "rng_state_0.pt", "scheduler.pt",
              "tokenizer.json", "trainer_state.json"]
MODEL = [("config.json", "config.json"), ("model.safetensors", "model.safetensors"),
         ("tokenizer.json", "tokenizer.json")]


def test_each_hub_strategy_pushes_what_transformers_trainer_pushes():
    assert hub.checkpoint_upload("end", "ck", CHECKPOINT, 5) is None
    every = hub.checkpoint_upload("every_save", "ck", CHECKPOINT, 5)
    assert list(every.files) == MODEL and every.message == "Training in progress, step 5"
    last = hub.checkpoint_upload("checkpoint", "ck", CHECKPOINT, 5)
    assert list(last.files) == MODEL + [(f, f"last-checkpoint/{f}") for f in CHECKPOINT]
    every_one = hub.checkpoint_upload("all_checkpoints", "ck", CHECKPOINT, 5)
    assert list(every_one.files) == MODEL + [(f, f"checkpoint-5/{f}") for f in CHECKPOINT]
    final = hub.final_upload("final", ["README.md", "model.safetensors"], 40)
    assert list(final.files) == [("README.md", "README.md"), ("model.safetensors", "model.safetensors")]
    assert final.message == "End of training: final/ after step 40"


# ---- the start-up check ---------------------------------------------------------------------------------------------

def hub_config(tmp_path, **values):
    return make_config({"push_to_hub": True, "output_dir": str(tmp_path / "my-run"), **values})


def test_the_start_up_check_creates_the_repository_and_branch_with_the_token(online, fake_hub, monkeypatch,
                                                                            tmp_path):
    monkeypatch.setattr(online, "ENDPOINT", fake_hub.url)
    target = hub.connect(hub_config(tmp_path, hub_token=TOKEN, hub_private_repo=True, hub_revision="exp"))
    assert (target.repo_id, target.revision, target.strategy) == ("tester/my-run", "exp", "every_save")
    assert fake_hub.created == [{"name": "my-run", "organization": "tester", "visibility": "private"}]
    assert fake_hub.branches == ["exp"] and fake_hub.auth == {f"Bearer {TOKEN}"}
    assert TOKEN not in repr(target)
    # a token from the environment, a repository named in full
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert hub.connect(hub_config(tmp_path, hub_model_id="org/named")).repo_id == "org/named"


def test_the_start_up_check_refuses_what_would_fail_hours_later(online, fake_hub, silent_hub, monkeypatch, tmp_path):
    cfg = hub_config(tmp_path, hub_token=TOKEN)
    monkeypatch.setattr(online, "ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    with pytest.raises(ConfigError, match=r"^push_to_hub: the hub at http://127\.0\.0\.1:\d+ cannot be reached "
                                          r"\(checking the token: ConnectError.*\); check the network \(or "
                                          r"HF_ENDPOINT\), or set push_to_hub false to train without pushing"):
        hub.connect(cfg)
    monkeypatch.setattr(online, "ENDPOINT", silent_hub)
    start = time.time()
    with pytest.raises(ConfigError, match=r"push_to_hub: the hub at .* did not answer within 1 s \(checking the "
                                          r"token\)"):
        hub.connect(cfg, timeout=1)
    assert time.time() - start < 5
    monkeypatch.setattr(online, "ENDPOINT", fake_hub.url)
    with pytest.raises(ConfigError, match=r"push_to_hub: no Hugging Face token found; log in with `hf auth login`, "
                                          r"set HF_TOKEN, or give hub_token"):
        hub.connect(hub_config(tmp_path))
    with pytest.raises(ConfigError, match=r"push_to_hub: the hub refused the token \(401"):
        hub.connect(hub_config(tmp_path, hub_token="hf_wrong"))
    fake_hub.role = "read"
    with pytest.raises(ConfigError, match=r"push_to_hub: the token can only read"):
        hub.connect(cfg)
    monkeypatch.setattr(online, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError, match=r"push_to_hub: the hub's offline mode is on"):
        hub.connect(cfg)


def test_a_run_with_push_to_hub_and_no_hub_stops_at_start_up_before_any_model_loads(tmp_path, tiny_model):
    port = closed_port()
    proc = train(["--model_name_or_path", tiny_model, "--max_steps", "1", *TINY, "--output_dir",
                  str(tmp_path / "run"), "--push_to_hub", "true"], tmp_path,
                 hub_env(f"http://127.0.0.1:{port}", tmp_path))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"configuration error: push_to_hub: the hub at http://127.0.0.1:{port} cannot be reached "
                           f"(checking the token: ConnectError"), last
    assert "set push_to_hub false" in last
    assert "memory:" not in proc.stdout + proc.stderr and not (tmp_path / "run").exists()  # nothing loaded or made


def test_a_run_with_push_to_hub_and_the_hubs_offline_mode_on_stops_at_start_up_with_one_line(tmp_path, tiny_model,
                                                                                            monkeypatch, capsys):
    """HF_HUB_OFFLINE=1 (as on many offline clusters) with push_to_hub: the run stops before any model loads, and
    its one line says that offline mode is on and both ways out, instead of training and failing to push. The
    script in this process (runpy runs its __main__ block; the test above runs it from the command line), offline
    mode as huggingface_hub reads HF_HUB_OFFLINE at its import: its constant."""
    import runpy

    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(REPO / "train_agrpo.py"), "--model_name_or_path", tiny_model, "--max_steps",
                                      "1", *TINY, "--output_dir", str(tmp_path / "run"), "--push_to_hub", "true"])
    with pytest.raises(SystemExit) as stopped:
        runpy.run_path(str(REPO / "train_agrpo.py"), run_name="__main__")
    # a message (printed as the one line, exit status 1), not a traceback
    assert stopped.value.code == ("configuration error: push_to_hub: the hub's offline mode is on (HF_HUB_OFFLINE or "
                                  "TRANSFORMERS_OFFLINE), so nothing can be pushed; unset it, or set push_to_hub "
                                  "false to train without pushing (final/ is written either way)")
    printed = capsys.readouterr()
    assert "memory:" not in printed.out + printed.err and not (tmp_path / "run").exists()  # nothing loaded or made


# ---- pushes ---------------------------------------------------------------------------------------------------------

@pytest.mark.slow  # a whole tiny-model run (about 8 s): the whole suite runs it, the fast one stays fast
def test_a_run_pushes_its_checkpoint_and_final_model_as_the_hub_receives_them(fake_hub, tmp_path, tiny_model):
    out = tmp_path / "run"
    proc = train(["--model_name_or_path", tiny_model, "--max_steps", "1", *TINY, "--output_dir", str(out),
                  "--push_to_hub", "true", "--hub_strategy", "checkpoint", "--hub_model_id", "tiny-grpo",
                  "--hub_revision", "exp", "--hub_token", TOKEN], tmp_path, hub_env(fake_hub.url, tmp_path, token=None))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert fake_hub.auth == {f"Bearer {TOKEN}"} and fake_hub.created[0]["name"] == "tiny-grpo"
    assert fake_hub.branches == ["exp"]
    # two commits on the branch, in order: checkpoint-1 (model files at the root, all of it in last-checkpoint/),
    # then final/ at the root; every file byte for byte as on disk
    assert [(c["revision"], c["message"]) for c in fake_hub.commits] == [
        ("exp", "Training in progress, step 1"), ("exp", "End of training: final/ after step 1")]
    checkpoint, final = files_under(out / "checkpoint-1"), files_under(out / "final")
    model_files = {k: v for k, v in checkpoint.items() if hub.is_model_file(k)}
    assert set(model_files) == {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                                "tokenizer_config.json", "chat_template.jinja"}
    assert fake_hub.commits[0]["files"] == {**model_files, **{f"last-checkpoint/{k}": v for k, v in checkpoint.items()}}
    assert "last-checkpoint/optimizer.pt" in fake_hub.commits[0]["files"]
    assert fake_hub.commits[1]["files"] == final and {"README.md", "generation_config.json"} <= set(final)
    assert fake_hub.validated == [final["README.md"].decode()]  # the hub checks the card's front matter
    assert "push_to_hub: final/ pushed to " + fake_hub.url + "/tester/tiny-grpo/tree/exp" in proc.stdout
    # the token is nowhere on disk nor in the card, which quotes the exact command with the token hidden
    for name, data in files_under(out).items():
        assert TOKEN.encode() not in data, name
    readme = final["README.md"].decode()
    assert "--hub_token '***'" in readme and "The command that produced this model:" in readme
    assert 'from_pretrained("tester/tiny-grpo")' in readme
    # final/ loads with transformers, with the sampling the run trained with
    from transformers import AutoModelForCausalLM, GenerationConfig

    AutoModelForCausalLM.from_pretrained(out / "final")
    generation = GenerationConfig.from_pretrained(out / "final")
    assert (generation.do_sample, generation.temperature, generation.top_p, generation.top_k) == (True, 0.7, 1.0, 0)
    assert generation.max_new_tokens == 8


@pytest.mark.slow  # a whole tiny-model run (about 8 s): the whole suite runs it, the fast one stays fast
def test_a_hub_that_fails_the_push_leaves_every_file_whole_and_says_how_to_push(tmp_path, tiny_model):
    server = FakeHub(fail_commits=True)
    try:  # a LoRA run: final/ is an adapter folder, with its own card
        out = tmp_path / "run"
        proc = train(["--model_name_or_path", tiny_model, "--max_steps", "1", *TINY, "--output_dir", str(out),
                      "--use_peft", "true", "--lora_r", "4", "--push_to_hub", "true", "--hub_strategy",
                      "all_checkpoints"], tmp_path, hub_env(server.url, tmp_path))
    finally:
        server.close()
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "push_to_hub: pushing checkpoint-1 to tester/run failed (HfHubHTTPError: Server error '500" in proc.stdout
    assert "training goes on, the checkpoint is whole on disk" in proc.stdout
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"training stopped: final/ is written and whole in {out / 'final'}, but push_to_hub could "
                           f"not push it to tester/run: HfHubHTTPError: Server error '500"), last
    assert f"Push it by hand with `hf upload tester/run {out / 'final'} .`" in last
    # nothing on disk was touched by the failed pushes: final/ loads, and the checkpoint is whole
    from peft import AutoPeftModelForCausalLM
    from transformers import GenerationConfig

    AutoPeftModelForCausalLM.from_pretrained(out / "final")
    assert GenerationConfig.from_pretrained(out / "final").top_k == 0
    readme = (out / "final" / "README.md").read_text()  # ours, over PEFT's template
    assert front_matter(readme)["library_name"] == "peft" and "AutoPeftModelForCausalLM" in readme
    assert json.loads((out / "checkpoint-1" / "trainer_state.json").read_text())["global_step"] == 1
    assert (out / "checkpoint-1" / "optimizer.pt").stat().st_size > 0


def test_pushes_go_one_at_a_time_and_a_silent_hub_never_holds_the_run(online, silent_hub, tmp_path):
    # online: with HF_HUB_OFFLINE=1 in the environment huggingface_hub refuses the commit at once, and the push this
    # test needs running would end before it is seen
    for step in (1, 2, 3):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "config.json").write_text("{}")
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "config.json").write_text("{}")
    said = []
    pusher = hub.HubPusher(hub.HubTarget("tester/run", None, silent_hub, "every_save", TOKEN), said.append)
    start = time.time()
    pusher.push_checkpoint(tmp_path / "checkpoint-1", 1)  # the hub never answers it
    wait_until(pusher.running, 10, "the push of checkpoint-1 to start", detail=lambda: f"the pusher said {said}")
    for step in (2, 3):  # 2 waits, and gives way to 3
        pusher.push_checkpoint(tmp_path / f"checkpoint-{step}", step)
    assert time.time() - start < 1 and pusher.running() == "checkpoint-1"  # training never waits on a push
    error = pusher.push_final(tmp_path / "final", 3, timeout=1)
    assert time.time() - start < 5
    assert error.startswith(f"final/ is written and whole in {tmp_path / 'final'}, but push_to_hub could not push it "
                            f"to tester/run: the push did not finish within 1 s")
    assert said == ["push_to_hub: checkpoint-2 was not pushed (the previous push was still running); checkpoint-3 "
                    "goes instead"]
    pusher.close()
    assert said[1].startswith("push_to_hub: the push of checkpoint-1 to tester/run was still running and is "
                              "abandoned; the files are whole on disk")
    assert (tmp_path / "final" / "config.json").read_text() == "{}"


def test_the_token_never_reaches_config_yaml_checkpoints_or_trackers():
    cfg = make_config({"hub_token": TOKEN, "push_to_hub": True})
    assert cfg.hub_token == TOKEN and to_dict(cfg)["hub_token"] is None
    with pytest.raises(ConfigError, match=r"^hub_token is empty"):
        make_config({"hub_token": " "})
    with pytest.raises(ConfigError, match=r"^hub_strategy: 'often' is not one of end, every_save, checkpoint, "
                                          r"all_checkpoints \(TRL's values\)$"):
        make_config({"hub_strategy": "often"})
    with pytest.raises(ConfigError, match=r"^hub_model_id: 'a/b/c' is not a repository id"):
        hub.check_settings(make_config({"hub_model_id": "a/b/c"}))
