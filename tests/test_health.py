"""lib/apps/health.py on real metric lines: the preset runs in docs/results/presets_embedded (embedded model, 40 steps
each) and the runs in tests/fixtures/ (how each was produced: tests/fixtures/README.md)."""

import json
from pathlib import Path

import pytest
import yaml

from conftest import REPO
from lib.apps import health

PRESETS = REPO / "docs" / "results" / "presets_embedded"
FIXTURES = REPO / "tests" / "fixtures"


def run(folder: Path) -> tuple[list[dict], dict]:
    lines = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return lines, yaml.safe_load((folder / "config.yaml").read_text())


def training(lines):
    return [m for m in lines if "reward" in m]


def mean(values):
    values = list(values)
    return sum(values) / len(values)


def kinds(warnings):
    return {w.kind for w in warnings}


PRESET_RUNS = sorted(p.parent for p in PRESETS.glob("**/metrics.jsonl"))


def test_kl_far_above_target_on_the_agrpo_preset_run_with_its_numbers_and_advice():
    lines, config = run(PRESETS / "agrpo")
    last = training(lines)[-health.WINDOW:]
    ema = mean(m["kl_ema"] for m in last)
    assert ema > 2 * config["kl_target"]  # the run's controller never held its target
    (warning,) = [w for w in health.check(lines, config) if w.kind == "kl_above_target"]
    assert warning.step == last[-1]["step"] and warning.first_step == last[0]["step"]
    assert f"KL moving average {ema:.3f}" in warning.evidence
    assert f"{ema / config['kl_target']:.1f}x kl_target {config['kl_target']:g}" in warning.evidence
    assert f"beta_t is {last[-1]['next_beta']:.3g}" in warning.evidence  # far from beta_max: it grows too slowly
    assert f"--kl_beta_rate {2 * config['kl_beta_rate']:g}" in warning.advice and "--learning_rate" in warning.advice
    # the same lines with beta_t at its bound: the advice is the bound
    pinned = {**config, "beta_max": last[-1]["next_beta"]}
    (warning,) = [w for w in health.check(lines, pinned) if w.kind == "kl_above_target"]
    assert "at beta_max" in warning.evidence and "a higher --beta_max" in warning.advice
    # without the controller there is no target: grpo's KL is as high, and not compared with anything
    grpo_lines, grpo_config = run(PRESETS / "grpo")
    assert mean(m["kl"] for m in training(grpo_lines)[-5:]) > 2 * config["kl_target"]
    assert "kl_above_target" not in kinds(health.check(grpo_lines, grpo_config))
    assert "kl_above_target" not in kinds(health.check(lines))  # no configuration: no target known


@pytest.mark.parametrize("folder", PRESET_RUNS, ids=lambda p: str(p.relative_to(PRESETS)))
def test_truncation_and_zero_spread_fire_exactly_when_most_of_the_last_steps_are(folder):
    lines, config = run(folder)
    train = training(lines)
    for end in range(len(train)):
        window = train[max(0, end + 1 - health.WINDOW): end + 1]
        found = {w.kind: w for w in health.check(train[: end + 1], config)}
        truncated = mean(m["completions/clipped_ratio"] for m in window)
        flat = mean(m["frac_reward_zero_std"] for m in window)
        full = len(window) == health.WINDOW
        assert ("truncation" in found) == (full and truncated > 0.5), (folder.name, end)
        assert ("zero_spread" in found) == (full and flat > 0.5), (folder.name, end)
        if "truncation" in found:
            assert f"{100 * truncated:.0f}% of completions over steps {window[0]['step']}-{window[-1]['step']}" \
                in found["truncation"].evidence
            assert f"--max_completion_length {2 * config['max_completion_length']}" in found["truncation"].advice
        if "zero_spread" in found:
            assert f"{100 * flat:.0f}% of groups" in found["zero_spread"].evidence
            assert f"--num_generations {2 * config['num_generations']}" in found["zero_spread"].advice
            assert (f"--algo {config['algo']} " in found["zero_spread"].advice) is False  # not the run's own preset
        # the preset runs all gained held-out accuracy and kept most of their entropy
        assert not {"reward_hacking", "entropy_collapse"} & set(found)


def test_a_trainer_prints_each_warning_once_at_the_step_it_first_holds():
    """What train_agrpo.py would do with its own history: check after each logged line, print the unseen kinds."""
    lines, config = run(PRESETS / "agrpo")
    seen, printed, history = set(), [], []
    for line in lines:
        history.append(line)
        for warning in health.unseen(health.check(history, config), seen):
            seen.add(warning.kind)
            printed.append((line["step"], warning.kind, health.console_line(warning)))
    assert len(printed) == len(seen)  # each kind once
    assert seen == {w.kind for w in health.episodes(lines, config)} == {"truncation", "zero_spread",
                                                                        "kl_above_target"}
    for step, kind, line in printed:
        before = [m for m in lines if m["step"] < step]
        assert kind not in kinds(health.check(before, config))  # not one line earlier
        assert line.startswith("warning (steps ") and ". Try: " in line


def test_episodes_span_the_steps_where_a_warning_held_and_merge_short_gaps():
    lines, config = run(PRESETS / "agrpo")
    train = training(lines)
    held = [m["step"] for i, m in enumerate(train)
            if "kl_above_target" in kinds(health.check(train[: i + 1], config))]
    (kl,) = [w for w in health.episodes(lines, config) if w.kind == "kl_above_target"]
    assert kl.step == held[-1] == train[-1]["step"]
    assert kl.first_step == held[0] - health.WINDOW + 1  # the first window it held over starts there
    # dr_grpo's zero-spread share hovers around the threshold: firings whose windows touch (at most WINDOW steps
    # apart) make one stretch, a longer lapse starts another
    lines, config = run(PRESETS / "dr_grpo")
    train = training(lines)
    held = [m["step"] for i, m in enumerate(train) if "zero_spread" in kinds(health.check(train[: i + 1], config))]
    stretches = []
    for step in held:
        if stretches and step - stretches[-1][-1] <= health.WINDOW:
            stretches[-1].append(step)
        else:
            stretches.append([step])
    assert any(b - a > 1 for a, b in zip(held, held[1:])) and len(stretches) > 1  # it lapsed, briefly and not
    found = [(w.first_step, w.step) for w in health.episodes(lines, config) if w.kind == "zero_spread"]
    assert found == [(s[0] - health.WINDOW + 1, s[-1]) for s in stretches]


def test_reward_hacking_on_a_run_trained_to_answer_wrongly():
    """tests/fixtures/reward_hacking: the embedded model rewarded for wrong answers, evaluated every 5 steps."""
    lines, config = run(FIXTURES / "reward_hacking")
    evals = [m for m in lines if "eval/accuracy" in m]
    train = training(lines)
    best = max(evals[:-1], key=lambda e: e["eval/accuracy"])
    last = evals[-1]
    assert last["eval/accuracy"] < best["eval/accuracy"]
    (warning,) = [w for w in health.check(lines, config) if w.kind == "reward_hacking"]
    assert f"held-out accuracy {best['eval/accuracy']:.3f} at step {best['step']} -> " \
           f"{last['eval/accuracy']:.3f} at step {last['step']}" in warning.evidence
    between = [m["reward"] for m in train if best["step"] < m["step"] <= last["step"]]
    assert f"rose {mean(between[:5]):.3f} -> {mean(between[-5:]):.3f}" in warning.evidence
    assert "the starting model (step 0) scored better" in warning.advice and best["step"] == 0
    assert "a reward that checks the answer (--reward_funcs accuracy" in warning.advice
    # it holds from the first evaluation that showed the drop on, not before
    first = next(i for i, m in enumerate(lines) if "eval/accuracy" in m and m["step"] > 0 and
                 "reward_hacking" in kinds(health.check(lines[: i + 1], config)))
    assert "reward_hacking" not in kinds(health.check(lines[:first], config))
    # a drop within the evaluation's noise is not reported: the same run scored on 10 problems
    noisy = [{**m, "eval/num_problems": 10.0} if "eval/accuracy" in m else m for m in lines]
    noise = 2 * sum(e["eval/accuracy"] * (1 - e["eval/accuracy"]) / 10 for e in (best, last)) ** 0.5
    assert best["eval/accuracy"] - last["eval/accuracy"] < noise  # the premise
    assert "reward_hacking" not in kinds(health.check(noisy, config))


def test_entropy_collapse_on_a_run_with_a_learning_rate_far_too_high():
    """tests/fixtures/entropy_collapse: the tiny random model at learning rate 0.05."""
    lines, config = run(FIXTURES / "entropy_collapse")
    train = training(lines)
    start = mean(m["entropy"] for m in train[: health.WINDOW])
    now = mean(m["entropy"] for m in train[-health.WINDOW:])
    assert now < health.ENTROPY_COLLAPSE_RATIO * start
    (warning,) = [w for w in health.check(lines, config) if w.kind == "entropy_collapse"]
    assert f"entropy {now:.3f} nats/token" in warning.evidence and f"of the {start:.3f} of steps" in warning.evidence
    assert f"now {config['learning_rate']:g}" in warning.advice and "--algo dapo" in warning.advice


# a reward that is the same for every completion: every group has zero spread, and random 8-token text never ends
# within 8 tokens, so both warnings hold from the fifth step (WINDOW) on
def warned(*args: str) -> list[str]:
    from test_loop import REWARDS

    return ["--reward_funcs", f"{REWARDS}:one", "--reward_weights", "1", "--correctness_reward", "one",
            "--save_steps", "3", *args]


def train_one_thread(tiny_model, out, *args) -> None:
    import torch
    from accelerate.state import AcceleratorState

    from test_loop import train

    AcceleratorState._reset_state(reset_partial_state=True)  # a state an earlier test left (its precision) goes
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(tiny_model, out, *args)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def warned_run(tmp_path_factory, tiny_model) -> tuple[Path, str]:
    """Six steps of that run (checkpoints at 3 and 6; the warnings came at step 5), run once: its folder and what it
    printed. Each test below resumes a copy of it."""
    import contextlib
    import io

    out = tmp_path_factory.mktemp("warned") / "run"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        train_one_thread(tiny_model, out, *warned("--max_steps", "6"))
    return out, printed.getvalue()


def test_the_trainer_prints_a_warning_once_and_not_again_after_a_resume(tiny_model, tmp_path, capsys, warned_run):
    """A real run on the tiny model with a reward that is the same for every completion: every group has zero
    spread, so the warning holds from the fifth step (WINDOW) on; printed there once, and not again by the same run
    resumed from its last checkpoint and run further (the kinds it printed come back from metrics.jsonl); the run
    folder's warnings.jsonl holds each once."""
    import shutil

    shutil.copytree(warned_run[0], tmp_path / "run")
    first = warned_run[1]
    capsys.readouterr()
    train_one_thread(tiny_model, tmp_path / "run", *warned("--max_steps", "11",
                                                                  "--resume_from_checkpoint", "latest"))
    again = capsys.readouterr().out
    lines = sorted(line for line in first.splitlines() if line.startswith("warning ("))
    # random 8-token text never ends within 8 tokens: every completion is cut as well
    assert len(lines) == 2 and all(line.startswith("warning (steps 1-5): ") for line in lines)
    assert "most completions truncated: 100% of completions over steps 1-5" in lines[0]
    assert "--max_completion_length 16 (now 8)" in lines[0]
    assert "most groups have zero reward spread: 100% of groups over steps 1-5" in lines[1]
    assert "--num_generations 8 (now 4)" in lines[1]
    assert "step 11/11" in again and "warning (" not in again  # 5 more steps: it would hold again
    # the run folder's log says the same once: both warnings at step 5, with the numbers the console printed
    logged = [json.loads(line) for line in (tmp_path / "run" / "warnings.jsonl").read_text().splitlines()]
    assert sorted((w["step"], w["kind"]) for w in logged) == [(5, "truncation"), (5, "zero_spread")]
    for w in logged:
        assert any(line == f"warning (steps 1-5): {w['title']}: {w['evidence']}. Try: {w['advice']}" for line in lines)


def test_a_resume_before_a_warning_sets_its_line_aside_and_says_it_again_once(tiny_model, tmp_path, capsys,
                                                                             warned_run):
    """The same run resumed from its step-3 checkpoint (the warnings came at step 5): warnings.jsonl keeps no line of
    the redone steps (they move to warnings.orphaned.jsonl, as metrics.jsonl's do), and the resumed run says both
    warnings again, once each."""
    import shutil

    shutil.copytree(warned_run[0], tmp_path / "run")
    shutil.rmtree(tmp_path / "run" / "checkpoint-6")
    shutil.rmtree(tmp_path / "run" / "final")
    capsys.readouterr()
    train_one_thread(tiny_model, tmp_path / "run", *warned("--max_steps", "6",
                                                                  "--resume_from_checkpoint", "latest"))
    again = capsys.readouterr().out
    assert sum(line.startswith("warning (steps 1-5): ") for line in again.splitlines()) == 2
    logged = [json.loads(line) for line in (tmp_path / "run" / "warnings.jsonl").read_text().splitlines()]
    assert sorted((w["step"], w["kind"]) for w in logged) == [(5, "truncation"), (5, "zero_spread")]
    orphaned = (tmp_path / "run" / "warnings.orphaned.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["kind"] for line in orphaned) == ["truncation", "zero_spread"]


def test_the_command_line_lists_what_held_and_what_holds_now(capsys, tmp_path):
    health.main([str(PRESETS / "agrpo"), str(tmp_path)])
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("agrpo: 40 training steps; held: truncation 1-20, zero_spread 1-19, kl_above_target 9-40")
    assert out[1].startswith("  now: warning (steps 36-40): KL far above the controller's target")
    assert out[2].endswith("no metrics.jsonl (not a run folder, or the run has not logged a step yet)")


