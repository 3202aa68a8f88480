"""The run view: lib/apps/runs.py and the Run tab's functions on real run files (docs/results/presets_embedded, the
runs in tests/fixtures/, see tests/fixtures/README.md), then the page in headless Chromium while a real run's lines
are appended to its files (slow)."""

import json
import shutil
from pathlib import Path

import pytest

from conftest import REPO, start_page, wait_for_page
from lib.apps import runs

PRESETS = REPO / "docs" / "results" / "presets_embedded"
EMBEDDED_RUN = REPO / "tests" / "fixtures" / "embedded_run"  # 6 steps of the default run: completions included


def lines_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_a_half_written_last_line_is_skipped_and_counted(tmp_path):
    text = (PRESETS / "grpo" / "metrics.jsonl").read_text()
    whole = lines_of(PRESETS / "grpo" / "metrics.jsonl")
    run_dir = tmp_path / "grpo"
    run_dir.mkdir()
    shutil.copy(PRESETS / "grpo" / "config.yaml", run_dir)
    last = text.rstrip("\n").rsplit("\n", 1)[1]
    cut = len(text) - 1 - len(last) // 2
    (run_dir / "metrics.jsonl").write_text(text[:cut])  # the writer is half-way through its last line
    records, bad = runs.read_jsonl(run_dir / "metrics.jsonl")
    assert records == whole[:-1] and bad == 1
    run = runs.load_run(run_dir)
    assert "1 incomplete line(s) of metrics.jsonl skipped" in runs.status(run)
    assert run.train[-1]["step"] == 40 and len(run.evals) == 1  # the last evaluation line is the one cut
    with open(run_dir / "metrics.jsonl", "a") as f:  # the writer finishes: the same path, new contents
        f.write(text[cut:])
    records, bad = runs.read_jsonl(run_dir / "metrics.jsonl")
    assert records == whole and bad == 0
    assert runs.read_jsonl(tmp_path / "missing.jsonl") == ([], 0)


def test_folders_of_runs_are_found_and_named_apart(tmp_path):
    found = runs.find_runs(PRESETS)
    assert found == sorted(p.parent for p in PRESETS.glob("**/metrics.jsonl")) and len(found) == 14
    assert runs.find_runs(PRESETS / "agrpo") == [PRESETS / "agrpo"]
    assert runs.find_runs(tmp_path) == [] and runs.find_runs(tmp_path / "missing") == []
    labels = runs.labels_for(found)
    assert len(set(labels)) == 14 and "presets_embedded/agpo" in labels and "seed43/agpo" in labels
    missing = runs.load_run(tmp_path / "not_yet")
    assert not missing.exists and "does not exist" in runs.status(missing, "runs/not_yet")
    assert "python train_agrpo.py --output_dir runs/not_yet" in runs.status(missing, "runs/not_yet")
    (tmp_path / "loading").mkdir()
    (tmp_path / "loading" / "config.yaml").write_text("max_steps: 40\n")
    assert "no metrics.jsonl yet" in runs.status(runs.load_run(tmp_path / "loading"))


def test_curves_leave_out_constant_fields_and_show_every_controller_field():
    grpo, agrpo, dsf = (runs.load_run(PRESETS / name, name) for name in ("grpo", "agrpo", "agpo_dsf"))
    panels, constant = runs.panels([grpo])
    names = [p.name for p in panels]
    assert names[:3] == ["reward", "accuracy", "kl"] and "beta" not in names and "epsilon" not in names
    assert constant["beta"] == "0.04" and constant["learning_rate"] == "2e-05"
    assert "temperature" in constant  # logged as 0.69999987 and 0.7: float32 rounding is not a change
    reward = next(p for p in panels if p.name == "reward")
    assert {s for _, _, s in reward.rows} == {"total", "accuracy"} and reward.points == 2 * len(grpo.train)
    assert all(p.title and p.unit for p in panels)
    # A-GRPO: beta_t, epsilon_t and the KL moving average against its target
    panels, _ = runs.panels([agrpo])
    by_name = {p.name: p for p in panels}
    assert {s for _, _, s in by_name["beta"].rows} == {"this step", "next step"}
    target = [(x, y) for x, y, s in by_name["kl_ema"].rows if s == "kl_target"]
    assert target == [(1.0, 0.05), (40.0, 0.05)]
    # AGPO-DSF: the per-group clip range as a band, and each of its statistics
    panels, _ = runs.panels([dsf])
    by_name = {p.name: p for p in panels}
    band = by_name["epsilon"].rows
    low = {x: y for x, y, s in band if s == "per-group min"}
    high = {x: y for x, y, s in band if s == "per-group max"}
    assert len(low) == len(dsf.train) and all(low[x] <= high[x] for x in low)
    assert {"dsf_step_kl", "dsf_entropy", "dsf_probe", "dsf_uncertainty", "extra_tokens"} <= set(by_name)
    # side by side: a field that varies in one run is drawn for both, each series named by its run
    panels, constant = runs.panels([grpo, agrpo])
    beta = next(p for p in panels if p.name == "beta")
    assert {s for _, _, s in beta.rows} == {"grpo: this step", "agrpo: this step", "agrpo: next step"}
    assert "beta" not in constant and constant["num_generations"] == "8"


def test_curves_align_by_generated_tokens():
    dapo, grpo = (runs.load_run(PRESETS / name, name) for name in ("dapo", "grpo"))
    panels, _ = runs.panels([dapo, grpo], x="num_tokens")
    reward = next(p for p in panels if p.name == "reward")
    dapo_total = [(x, y) for x, y, s in reward.rows if s == "dapo: total"]
    assert dapo_total == [(m["num_tokens"], m["reward"]) for m in dapo.train]
    accuracy = next(p for p in panels if p.name == "accuracy")
    points = [(x, y) for x, y, s in accuracy.rows if s == "dapo: accuracy"]
    assert points == [(0.0, dapo.evals[0]["eval/accuracy"]), (dapo.train[-1]["num_tokens"],
                                                              dapo.evals[-1]["eval/accuracy"])]
    # the same 40 steps are different budgets (DAPO samples again, its completions are shorter): the axis shows it
    ends = {s.split(": ")[0]: x for x, _, s in reward.rows}
    assert ends == {"dapo": dapo.train[-1]["num_tokens"], "grpo": grpo.train[-1]["num_tokens"]}
    assert ends["dapo"] != ends["grpo"]
    speed = [m[runs.TOKENS_PER_SECOND] for m in grpo.train]
    assert speed[1] == pytest.approx((grpo.train[1]["num_tokens"] - grpo.train[0]["num_tokens"])
                                     / grpo.train[1]["step_time"])


def test_completions_browser_rows_filters_and_nearest_checkpoint(tmp_path):
    from lib.apps.page import split_reasoning

    run_dir = tmp_path / "run"
    shutil.copytree(EMBEDDED_RUN, run_dir)
    run = runs.load_run(run_dir)
    logged = lines_of(run_dir / "completions.jsonl")
    rows = runs.completion_rows(run, split_reasoning)
    assert len(rows) == len(logged) and [r["step"] for r in rows] == sorted((r["step"] for r in logged),
                                                                            reverse=True)
    instruction = run.config["instruction"]
    for row in rows:
        assert row["problem"] and row["problem"] in row["prompt"] and instruction not in row["problem"]
        assert "<|" not in row["problem"] and not row["problem"].startswith("user")
        assert (row["reasoning"], row["final"]) == split_reasoning(row["completion"])
        temperature = next(m["temperature"] for m in run.train if m["step"] == row["step"])
        assert row["temperature"] == temperature and row["temperature_of"] == "step mean"
    positive = runs.filter_completions(rows, sign="> 0")
    assert positive and len(positive) == sum(r["advantage"] > 0 for r in logged) < len(rows)
    late = runs.filter_completions(rows, step_min=4, step_max=5, reward_min=1.0)
    assert len(late) == sum(4 <= r["step"] <= 5 and r["reward"] >= 1.0 for r in logged)
    assert runs.filter_completions(rows, reward_max=-1.0) == []
    with pytest.raises(ValueError):
        runs.filter_completions(rows, sign="positive")
    # the policy that sampled step s is the one after s - 1 updates
    assert runs.nearest_checkpoint(run, 3) is None
    for step in (2, 4):
        (run_dir / f"checkpoint-{step}").mkdir()
        (run_dir / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    run = runs.load_run(run_dir)
    assert [runs.nearest_checkpoint(run, s) for s in (1, 3, 4, 6)] == ["checkpoint-2", "checkpoint-2",
                                                                        "checkpoint-2", "checkpoint-4"]


def test_the_run_tab_refuses_folders_outside_its_roots_and_expands_a_folder_of_runs(tmp_path):
    from lib.apps.page import selected_runs, warnings_markdown

    roots = [PRESETS.resolve()]
    folders, messages = selected_runs([str(PRESETS / "seed43"), str(tmp_path)], roots)
    assert [f.name for f in folders] == ["agpo", "agpo_before", "dapo", "dapo_before", "gspo", "gspo_before"]
    assert len(messages) == 1 and "is outside the folders this page may open" in messages[0]
    text = warnings_markdown(runs.load_run(PRESETS / "agrpo", "agrpo"))
    assert "**KL far above the controller's target** (steps 36-40)" in text and "_Try:_" in text
    assert "earlier: most completions truncated (steps 1-20)" in text
    assert warnings_markdown(runs.load_run(PRESETS / "dapo", "dapo")) == ""


def test_timeline_of_a_resumed_run_and_a_window_of_steps(tmp_path):
    """The timeline's clock readings are not curves; a resumed run's clock starts again (only the lines since are
    drawn, a batch sampled before the resume left out); a window keeps the newest steps; a batch serves
    num_iterations x steps_per_generation / gradient_accumulation_steps steps."""
    def line(step, train, sample=None):
        extra = {"time/sample_start": sample[0], "time/sample_end": sample[1]} if sample else {}
        return {"step": step, "reward": 0.1 * step, "staleness": (step - 1) % 2, "time/train_start": train,
                "time/train_end": train + 1.0, **extra}

    lines = [line(1, 1.0, (0.0, 0.5)), line(2, 2.5), line(3, 4.0, (2.0, 3.5)), line(4, 5.5),  # resumed at step 4:
             line(5, 0.5, (7.0, 7.5)), line(6, 2.0), line(7, 3.0, (1.5, 2.5)), line(8, 4.5)]  # batch 2 kept
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    (tmp_path / "config.yaml").write_text("num_iterations: 2\nsteps_per_generation: 4\n"
                                          "gradient_accumulation_steps: 4\n")
    run = runs.load_run(tmp_path, "run")
    timeline = runs.timeline(run)
    assert timeline.steps == (5, 8) and timeline.restarted and timeline.left_out == 4
    assert [(b.name, b.start) for b in timeline.bars] == [("step 5", 0.5), ("batch 3", 1.5), ("step 6", 2.0),
                                                          ("step 7", 3.0), ("step 8", 4.5)]
    assert timeline.overlap == 0.5 and timeline.sampling_seconds == 1.0  # batch 3 while step 6 trained
    window = runs.timeline(run, 3)
    assert window.steps == (6, 8) and window.left_out == 5 and [b.batch for b in window.bars] == [3, 2, 3, 3]
    panels, constant = runs.panels([run])
    assert "time" not in [p.name for p in panels] and not set(runs.TIMELINE_KEYS) & set(constant)
    assert runs.timeline(runs.load_run(PRESETS / "grpo")) is None  # runs from before the timeline


def test_timeline_shows_sampling_alternate_with_training_or_overlap_it(tmp_path, tiny_model):
    """Real tiny runs, 6 steps on 3 generation batches (num_iterations 2): every step has a training bar and every
    batch a sampling bar, which ends before its first step trains; synchronous, no sampling bar overlaps a training
    bar; with max_staleness 1 the thread samples batch b from the weights after step 2b - 1, while step 2b trains."""
    import torch

    from lib.apps.page import TIMELINE_SLOTS, timeline_rows, timeline_title
    from test_loop import train

    threads, timelines = torch.get_num_threads(), {}
    torch.set_num_threads(1)
    try:
        for name, args in (("sync", []), ("async", ["--max_staleness", "1"])):
            train(tiny_model, tmp_path / name, "--max_steps", "6", "--num_iterations", "2", *args)
            timelines[name] = runs.timeline(runs.load_run(tmp_path / name, name))
    finally:
        torch.set_num_threads(threads)
    for name, timeline in timelines.items():
        training = [b for b in timeline.bars if b.lane == "training"]
        sampling = [b for b in timeline.bars if b.lane == "sampling"]
        assert [(b.step, b.batch) for b in training] == [(s, (s - 1) // 2) for s in range(1, 7)]
        assert [(b.batch, b.step) for b in sampling] == [(0, 1), (1, 3), (2, 5)]
        assert all(b.start <= b.end for b in timeline.bars)
        assert all(s.end <= training[s.step - 1].start for s in sampling)  # sampled before its first step trains
        overlapping = [(s.name, t.name) for s in sampling for t in training if s.start < t.end and t.start < s.end]
        rows = timeline_rows(timeline)  # two points a bar, a point without a time for each empty slot
        assert len([r for r in rows if r[0] is not None]) == 2 * len(timeline.bars) == 2 * 9
        assert len({r[2] for r in rows}) == len(rows) - 9 == len(TIMELINE_SLOTS)
        if name == "sync":
            assert overlapping == [] and timeline.overlap == 0
            assert all(s.start >= training[s.step - 2].end for s in sampling[1:])  # after the step before it
            assert "sampling and training alternate" in timeline_title(name, timeline)
        else:
            assert overlapping and set(overlapping) <= {("batch 1", "step 2"), ("batch 2", "step 4")}
            assert timeline.overlap > 0 and "sampling overlapped training" in timeline_title(name, timeline)


# ---------------------------------------------------------------------------------------------- the page, live


def tiny_run(out: Path, tiny_model: str) -> Path:
    """A real run of the trainer on the tiny random model: 6 steps, 4 completions logged a step, evaluations at
    steps 0, 3 and 6, checkpoints at 3 and 6 (the loop tests' settings, tests/test_loop.py)."""
    import torch
    from accelerate.state import AcceleratorState

    import train_agrpo
    from test_loop import TINY

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train_agrpo.main(["--model_name_or_path", tiny_model, *TINY, "--max_steps", "6", "--save_steps", "3",
                          "--log_completions", "4", "--num_eval_samples", "4", "--eval_steps", "3",
                          "--output_dir", str(out)])
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        torch.set_num_threads(threads)
    return out


# vertices of the lines a gr.LinePlot drew (vega's SVG: one path per series, "M x,y L x,y ...")
CURVE_POINTS = """id => [...document.querySelectorAll(`#${id} .mark-line path`)]
    .reduce((n, p) => n + ((p.getAttribute('d') || '').match(/[ML]/g) || []).length, 0)"""


# bars a timeline drew (a series of two points each; its empty slots are paths without points)
BARS = "id => [...document.querySelectorAll(`#${id} .mark-line path`)].filter(p => p.getAttribute('d')).length"


def reward_points(metric_lines: list[str]) -> int:
    """Points the reward plot should hold for these lines: the total and each function's mean, those that vary."""
    train = [m for m in map(json.loads, metric_lines) if "reward" in m]
    keys = [k for k in train[0] if k == "reward" or k.startswith("rewards/") and k.endswith("/mean")]
    return sum(len(train) for k in keys if len({m[k] for m in train}) > 1)


def wait_for_text(view, selector: str, text: str, timeout_ms: int = 20_000) -> str:
    view.wait_for_function("([s, t]) => (document.querySelector(s)?.innerText || '').includes(t)",
                           arg=[selector, text], timeout=timeout_ms)
    return view.locator(selector).inner_text()


@pytest.mark.slow
@pytest.mark.browser
def test_browser_watches_a_run_being_written(tiny_model, tmp_path):
    """The page open on a run folder that does not exist yet; then the run's real lines arrive in three parts (the
    first ending in half a line, no checkpoint yet), the curves gain points, the completions browser filters, and a
    row opens in the chat with the nearest checkpoint."""
    sync_api = pytest.importorskip("playwright.sync_api")
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("Debian's chromium is not installed (.ci/run installs it)")
    live = tmp_path / "runs" / "live"
    log = tmp_path / "page.log"
    proc, port = start_page(["--run", "runs/live", "--model_name_or_path", tiny_model, "--refresh", "0.5"], tmp_path,
                            log)
    try:
        run = tiny_run(tmp_path / "tiny_run", tiny_model)  # while the page starts
        metrics = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
        completions = (run / "completions.jsonl").read_text().splitlines(keepends=True)
        logged = lines_of(run / "completions.jsonl")
        upto = next(i for i, line in enumerate(metrics) if json.loads(line).get("step") == 3 and "reward" in line)
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, headless=True, args=[
                "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync"])
            view = browser.new_page(viewport={"width": 1280, "height": 900})
            view.goto(wait_for_page(proc, port, log))
            # no run at all: a message, not a traceback
            status = wait_for_text(view, "#run-status", "no run here yet")
            assert "python train_agrpo.py --output_dir runs/live" in status
            # the run starts writing: steps 1-2 and half of step 3's line, no checkpoint yet
            live.mkdir(parents=True)
            shutil.copy(run / "config.yaml", live)
            (live / "metrics.jsonl").write_text("".join(metrics[:upto]) + metrics[upto][:40])
            (live / "completions.jsonl").write_text("".join(c for c in completions if json.loads(c)["step"] <= 2))
            status = wait_for_text(view, "#run-status", "steps 1-2 of 6")
            assert "no checkpoint yet" in status and "1 incomplete line(s) of metrics.jsonl skipped" in status
            view.wait_for_function(f"({CURVE_POINTS})('run-plot-0') > 0")
            assert "Reward: total and per function" in view.locator("#run-plot-0").text_content()
            before = view.evaluate(CURVE_POINTS, "run-plot-0")
            assert before == reward_points(metrics[:upto]) == 2 * 2  # has_x is 0 at both steps: not drawn yet
            # the rest of the run arrives, checkpoints included
            with open(live / "metrics.jsonl", "a") as f:
                f.write(metrics[upto][40:] + "".join(metrics[upto + 1:]))
            with open(live / "completions.jsonl", "a") as f:
                f.write("".join(c for c in completions if json.loads(c)["step"] > 2))
            for name in ("checkpoint-3", "checkpoint-6", "final"):
                shutil.copytree(run / name, live / name)
            status = wait_for_text(view, "#run-status", "checkpoints: 3, 6")  # a refresh during the copies
            assert "steps 1-6 of 6" in status and "incomplete" not in status  # saw part of them; the next one all
            view.wait_for_function(f"({CURVE_POINTS})('run-plot-0') > {before}")
            assert view.evaluate(CURVE_POINTS, "run-plot-0") == reward_points(metrics) == 3 * 6
            # the timeline: a bar per generation batch and per step (6 each), drawn thick, one after the other
            view.wait_for_function(f"({BARS})('run-timeline-0') === 12")
            assert "steps 1-6: sampling and training alternate" in view.locator("#run-timeline-0").text_content()
            assert view.evaluate("getComputedStyle(document.querySelector('#run-timeline-0 .mark-line path'))"
                                 ".strokeWidth") == "14px"
            assert "Traceback" not in view.content()
            # the completions browser: every logged completion, then filters
            wait_for_text(view, "#completions-note", f"{len(logged)} of {len(logged)} logged completions")
            view.locator("#filter-sign").get_by_text("> 0", exact=True).click()
            positive = sum(r["advantage"] > 0 for r in logged)
            assert 0 < positive < len(logged)
            wait_for_text(view, "#completions-note", f"{positive} of {len(logged)} logged completions")
            box = view.locator("#filter-step-min").locator("textarea, input").first
            box.fill("4")
            box.press("Enter")
            late = [r for r in logged if r["advantage"] > 0 and r["step"] >= 4]
            wait_for_text(view, "#completions-note", f"{len(late)} of {len(logged)} logged completions")
            # a row, its completion with the reasoning folded, and its prompt in the chat with the nearest checkpoint
            view.locator("#completions [data-testid=cell-0-1]").click()  # the newest row's problem
            info = wait_for_text(view, "#completion-info", f"step {late[-1]['step']}")
            assert "advantage +" in info
            view.locator("#open-in-chat").click()
            nearest = min((3, 6), key=lambda s: (abs(s - (late[-1]["step"] - 1)), s))  # its policy: step - 1 updates
            status = wait_for_text(view, "#status", "checkpoint: loaded")
            assert status.rstrip().endswith(f"live/checkpoint-{nearest}")
            assert view.locator("#prompt textarea").input_value() in late[-1]["prompt"]
            browser.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert "Traceback" not in log.read_text()


def test_adaptive_entropy_controller_is_drawn_with_its_target(tmp_path):
    """use_adaptive_entropy (docs/methods.md 2.6): eta this step and the coefficient after it in a panel of their
    own, and the entropy of the trained tokens beside entropy_target in the entropy panel."""
    lines = [{"step": s, "reward": 0.1 * s, "entropy": 0.5 - 0.1 * s, "entropy/trained": 0.4 - 0.1 * s,
              "eta": 0.0 if s == 1 else 0.005 * (s - 1), "entropy_coef": 0.005 * s} for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    (tmp_path / "config.yaml").write_text("use_adaptive_entropy: true\nentropy_target: 0.2\n")
    panels, _ = runs.panels([runs.load_run(tmp_path, "run")])
    by_name = {p.name: p for p in panels}
    assert {s for _, _, s in by_name["eta"].rows} == {"this step", "next step"}
    entropy = by_name["entropy"].rows
    assert {s for _, _, s in entropy} == {"completion tokens", "trained tokens", "entropy_target"}
    assert [(x, y) for x, y, s in entropy if s == "entropy_target"] == [(1.0, 0.2), (3.0, 0.2)]
