"""The chat page's address (chat_app.py `listen_address`): Gradio's GRADIO_SERVER_NAME / GRADIO_SERVER_PORT when no
--host / --port is given, a flag winning over them, and the login rule applied to a host from the environment as to
a --host flag."""

import os
import socket
import subprocess
import sys

import pytest

from conftest import REPO, wait_for_page

sys.path.insert(0, str(REPO))
from chat_app import parse_args  # noqa: E402
from lib.apps.page import exposure  # noqa: E402


@pytest.fixture
def no_gradio_env(monkeypatch):
    for name in ("GRADIO_SERVER_NAME", "GRADIO_SERVER_PORT", "AGRPO_CHAT_AUTH"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_gradios_variables_set_the_address_and_a_flag_wins(no_gradio_env):
    args = parse_args([])
    assert (args.host, args.port) == ("127.0.0.1", 7860)
    no_gradio_env.setenv("GRADIO_SERVER_NAME", "localhost")
    no_gradio_env.setenv("GRADIO_SERVER_PORT", "7901")
    args = parse_args([])
    assert (args.host, args.port) == ("localhost", 7901) and exposure(args) is None
    args = parse_args(["--host", "127.0.0.1", "--port", "7002"])
    assert (args.host, args.port) == ("127.0.0.1", 7002)
    no_gradio_env.setenv("GRADIO_SERVER_PORT", "http")
    with pytest.raises(SystemExit, match=r"^error: GRADIO_SERVER_PORT: 'http' is not a port number \(1-65535\); set "
                                         r"it to one, unset it, or pass --port$"):
        parse_args([])
    assert parse_args(["--port", "7003"]).port == 7003  # the flag wins, the variable is not read


def test_a_host_from_the_environment_needs_a_login_as_a_flag_does(no_gradio_env):
    no_gradio_env.setenv("GRADIO_SERVER_NAME", "0.0.0.0")
    with pytest.raises(SystemExit, match=r"^error: GRADIO_SERVER_NAME=0\.0\.0\.0: the page would be open to other "
                                         r"machines without a login.*--auth USER:PASSWORD"):
        exposure(parse_args([]))
    assert exposure(parse_args(["--auth", "ana:s3cret-pw"])) == ("ana", "s3cret-pw")
    assert exposure(parse_args(["--host", "127.0.0.1"])) is None  # the flag wins: this machine only
    proc = subprocess.run([sys.executable, str(REPO / "chat_app.py"), "--model_name_or_path", "missing"],
                          capture_output=True, text=True, timeout=120,
                          env={**{k: v for k, v in os.environ.items() if k != "AGRPO_CHAT_AUTH"},
                               "GRADIO_SERVER_NAME": "0.0.0.0"})
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        "error: GRADIO_SERVER_NAME=0.0.0.0: the page would be open to other machines without a login, and it loads "
        "and runs model folders; pass --auth USER:PASSWORD (or set AGRPO_CHAT_AUTH=USER:PASSWORD), or "
        "--no_auth_i_know to expose it anyway"]


@pytest.mark.slow
def test_the_page_listens_where_gradios_variables_say(tmp_path, tiny_model):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "page.log"
    env = {**os.environ, "GRADIO_SERVER_NAME": "127.0.0.1", "GRADIO_SERVER_PORT": str(port),
           "GRADIO_ANALYTICS_ENABLED": "False", "TOKENIZERS_PARALLELISM": "false"}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(REPO / "chat_app.py"), "--model_name_or_path", tiny_model,
                                 "--base_model", tiny_model], cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
                                env=env)
    try:
        assert wait_for_page(proc, port, log, timeout_s=180) == f"http://127.0.0.1:{port}/"
    finally:
        proc.kill()
        proc.wait(timeout=60)
