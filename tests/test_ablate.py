"""scripts/ablate.py: ablations as overrides of the resolved presets, the seeds' table with mean and spread, and a
real (tiny) run of the harness on the embedded model: runs, evaluation, table, figures, token budget and resume."""

import csv
import json
import os
import math
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from lib.config import ConfigError, make_config, parse_config
from scripts.ablate import (AblateError, ablation_overrides, aggregate, mean_spread, parse_args, plan, run_env,
                            starvation, table_markdown, within_spread)
from scripts.ablate import main as ablate_main
from scripts.compare_presets import preset_steps, train_command

ABLATE = [sys.executable, str(REPO / "scripts" / "ablate.py")]


def resolved(method, *flags):
    return parse_config(["--algo", method, *flags])


def test_ablations_override_the_resolved_preset_and_switch_off_what_would_move_them():
    agrpo = resolved("agrpo")
    assert ablation_overrides("full", agrpo) == {}
    # A-GRPO's controller would move beta off 0 and epsilon off a fixed value: it is switched off / pinned
    assert ablation_overrides("no_kl", agrpo) == {"beta": 0.0, "adaptive_kl": False}
    assert ablation_overrides("no_kl", resolved("grpo")) == {"beta": 0.0}
    assert ablation_overrides("beta1.0", agrpo) == {"beta": 1.0, "adaptive_kl": False}
    assert ablation_overrides("eps0.5", agrpo) == {"epsilon": 0.5, "epsilon_high": 0.5, "epsilon_min": 0.5,
                                                   "epsilon_max": 0.5}
    dsf = ablation_overrides("no_clip", resolved("agpo_dsf"))
    assert dsf["dsf_eps_min"] == dsf["dsf_eps_max"] == dsf["epsilon"] == 1e6
    assert ablation_overrides("no_kl_no_entropy", agrpo) == {"beta": 0.0, "adaptive_kl": False, "eta": 0.0}
    # group size: the completions per step are kept, rounded up to whole groups
    assert ablation_overrides("g16", resolved("grpo", "--per_device_train_batch_size", "12")) == {
        "num_generations": 16, "adaptive_group_size": False, "per_device_train_batch_size": 16}
    assert "per_device_train_batch_size" not in ablation_overrides("g4", resolved("grpo"))
    with pytest.raises(AblateError, match="'no_such' is not one of full, no_clip"):
        ablation_overrides("no_such", agrpo)


def test_plan_resolves_every_configuration_first_and_shares_identical_runs(tmp_path):
    jobs = plan(["grpo", "agrpo"], ["full", "no_entropy", "no_kl", "g4"], [1, 2], ["--max_completion_length", "32"],
                tmp_path, 5, 3000)
    assert len(jobs) == 16
    by = {(j.method, j.ablation, j.seed): j for j in jobs}
    # GRPO's eta is already 0: its no_entropy run is its full run
    shared = by[("grpo", "no_entropy", 2)]
    assert shared.same_as == "grpo/full" and shared.run_dir == by[("grpo", "full", 2)].run_dir
    assert by[("agrpo", "no_entropy", 1)].same_as is None and by[("agrpo", "no_entropy", 1)].cfg.eta == 0.0
    no_kl = by[("agrpo", "no_kl", 1)].cfg
    assert no_kl.beta == 0.0 and no_kl.adaptive_kl is False and no_kl.kl_estimator == "symmetric"
    g4 = by[("agrpo", "g4", 2)].cfg
    assert (g4.num_generations, g4.seed, g4.max_steps, g4.max_num_tokens, g4.max_completion_length,
            g4.num_eval_samples) == (4, 2, 5, 3000, 32, 0)
    # one update per generation batch: the ratio is exactly 1, no clip binds, so no_clip / eps* share the full run;
    # AGPO-DSF (4 updates per batch) and --num_iterations 2 are trained for real
    clip = plan(["grpo", "agrpo", "agpo_dsf"], ["full", "no_clip", "eps0.5"], [1], [], tmp_path, 5, None)
    shared = {(j.method, j.ablation): j.same_as for j in clip}
    assert shared[("grpo", "no_clip")] == shared[("grpo", "eps0.5")] == "grpo/full"
    assert shared[("agrpo", "no_clip")] == shared[("agrpo", "eps0.5")] == "agrpo/full"
    assert shared[("agpo_dsf", "no_clip")] is None and shared[("agpo_dsf", "eps0.5")] is None
    twice = plan(["grpo"], ["full", "no_clip"], [1], ["--num_iterations", "2"], tmp_path, 4, None)
    assert twice[1].same_as is None and twice[1].cfg.epsilon == 1e6
    # a value the trainer refuses is named with its configuration before anything runs
    with pytest.raises(AblateError, match="grpo / full / seed 1: .*temperature"):
        plan(["grpo"], ["full"], [1], ["--temperature", "-1"], tmp_path, 5, None)
    with pytest.raises(AblateError, match="'nope' is not a preset"):
        plan(["nope"], ["full"], [1], [], tmp_path, 5, None)


def test_harness_arguments_are_checked_and_name_the_fix():
    with pytest.raises(AblateError, match="--ablations: eps0.3 not known"):
        parse_args(["--ablations", "full", "eps0.3"])
    with pytest.raises(AblateError, match="--seed after --: the harness sets it"):
        parse_args(["--", "--seed", "3"])
    with pytest.raises(AblateError, match="--token_budget must be at least 1"):
        parse_args(["--token_budget", "0"])
    args, extra = parse_args(["--methods", "agpo", "--", "--learning_rate", "1e-5"])
    assert args.methods == ["agpo"] and extra == ["--learning_rate", "1e-5"]


def test_max_num_tokens_is_checked_like_the_other_limits():
    assert resolved("grpo", "--max_num_tokens", "5000").max_num_tokens == 5000
    with pytest.raises(ConfigError, match="max_num_tokens must be at least 1 or null"):
        resolved("grpo", "--max_num_tokens", "0")


def test_train_command_resumes_an_interrupted_run_and_skips_a_finished_one(tmp_path):
    fresh = train_command("grpo", tmp_path / "a", 5, ["--seed", "1"])
    assert fresh[-6:] == ["--max_steps", "5", "--output_dir", str(tmp_path / "a"), "--seed", "1"]
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "metrics.jsonl").write_text("{}\n")
    assert train_command("grpo", tmp_path / "a", 5, [])[-2:] == ["--overwrite_output_dir", "true"]
    (tmp_path / "a" / "checkpoint-2").mkdir()
    (tmp_path / "a" / "checkpoint-2" / "trainer_state.json").write_text("{}")
    assert train_command("grpo", tmp_path / "a", 5, [])[-2:] == ["--resume_from_checkpoint", "latest"]
    (tmp_path / "a" / "final").mkdir()
    assert train_command("grpo", tmp_path / "a", 5, []) is None


def test_compare_presets_gives_every_preset_the_same_generation_batches():
    assert preset_steps("grpo", 40, []) == 40
    assert preset_steps("agpo_dsf", 40, []) == 160  # 4 updates on each of its 40 batches
    assert preset_steps("grpo", 40, ["--num_iterations", "2"]) == 80
    assert preset_steps("agpo_dsf", 10, ["--num_iterations", "1"]) == 10


def row(method, ablation, seed, win, accuracy=0.5):
    return {"method": method, "ablation": ablation, "seed": seed, "win_rate": win, "accuracy": accuracy,
            "accuracy_start": 0.2, "reward": accuracy, "kl": 0.01, "entropy": 0.5, "length": 30.0,
            "num_tokens": 1000, "steps": 10, "train_reward": 0.3, "zero_spread": 0.5, "no_signal_steps": 0.1,
            "same_as": ""}


def test_starvation_counts_groups_without_reward_spread_and_steps_where_every_group_had_none():
    train = [{"step": 1, "frac_reward_zero_std": 1.0}, {"step": 2, "frac_reward_zero_std": 0.5},
             {"step": 3, "frac_reward_zero_std": 1.0}, {"step": 4, "frac_reward_zero_std": 0.0}]
    assert starvation(train) == {"zero_spread": pytest.approx(0.625), "no_signal_steps": 0.5}
    assert all(math.isnan(v) for v in starvation([{"step": 1}]).values())  # a run that logged no groups


def test_table_shows_mean_and_spread_and_marks_differences_smaller_than_the_spread():
    assert mean_spread([0.6, 0.7]) == pytest.approx((0.65, 0.0707107), abs=1e-6)
    assert mean_spread([0.4]) == (0.4, 0.0)
    # |0.65 - 0.51| = 0.14 against hypot(0.0707, 0.0141) = 0.0721: a real difference; 0.05 against 0.0721: not
    assert not within_spread((0.65, 0.0707107), (0.51, 0.0141421))
    assert within_spread((0.56, 0.0707107), (0.51, 0.0141421))
    assert not within_spread((0.56, 0.0), (0.51, 0.0))  # one seed: no spread, nothing marked
    rows = [row("grpo", "full", 1, 0.50, 0.30), row("grpo", "full", 2, 0.52, 0.50),
            row("grpo", "no_kl", 1, 0.60, 0.40), row("grpo", "no_kl", 2, 0.70, 0.40),
            row("agrpo", "full", 1, 0.55, 0.70), row("agrpo", "full", 2, 0.57, 0.80),
            row("agrpo", "no_kl", 1, 0.50, 0.40), row("agrpo", "no_kl", 2, 0.50, 0.42)]
    agg = aggregate(rows)
    assert agg[("grpo", "no_kl")]["win_rate"] == pytest.approx((0.65, 0.0707107), abs=1e-6)
    text = table_markdown(agg, ["grpo", "agrpo"], ["full", "no_kl"])
    lines = {tuple(c.strip() for c in line.strip("|").split("|")[:2]): line for line in text.splitlines()
             if line.startswith("| full") or line.startswith("| no_kl")}
    # grpo no_kl against grpo full: win 65.0% +- 7.1% is a real difference, accuracy 40.0% +- 0.0% is not
    assert "| 65.0% ± 7.1% |" in lines[("no_kl", "grpo")] and "| 40.0% ± 0.0% ~ |" in lines[("no_kl", "grpo")]
    assert "~" not in lines[("full", "grpo")]  # the full row is the reference of the marks
    assert "Differences to grpo" in text
    # agrpo - grpo on full: win +5.0% (spread hypot(1.4%, 1.4%) = 2.0%: real), accuracy +35.0% (real)
    diff = [line for line in text.splitlines() if line.startswith("| full | agrpo | +")][0]
    assert diff.startswith("| full | agrpo | +5.0% | +35.0% |")


def test_a_grpo_readme_table_recipe_resolves_to_the_readme_training_settings(data_dir, tmp_path):
    # The dry run plans a GPU machine's runs on any machine: it must not need vLLM, which the recipe samples with.
    # Shown where vLLM is installed too, by an interpreter that cannot import it (None in sys.modules is what
    # importlib reports as not installed), set up by a sitecustomize the subprocess's Python reads at start.
    (tmp_path / "no_vllm").mkdir()
    (tmp_path / "no_vllm" / "sitecustomize.py").write_text("import sys\nsys.modules['vllm'] = None\n")
    env = {**os.environ, "DATA": str(data_dir / "gsm8k"), "OUT": str(tmp_path / "out"),
           "PYTHONPATH": os.pathsep.join([str(tmp_path / "no_vllm"), os.environ.get("PYTHONPATH", "")]),
           # the script calls `python`: the one running these tests, virtual environment or not
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    script = ["bash", str(REPO / "scripts" / "recipes" / "agrpo_readme_table.sh")]
    proc = subprocess.run([*script, "--dry_run"], capture_output=True, text=True, cwd=REPO, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the real run still asks for vLLM up front, before anything is written
    refused = subprocess.run(script, capture_output=True, text=True, cwd=REPO, timeout=120, env=env)
    assert refused.returncode != 0 and "use_vllm needs vLLM" in refused.stderr, refused.stderr[-3000:]
    assert not (tmp_path / "out").exists()
    settings = {}
    for line in proc.stdout.splitlines():
        if " / full / seed 42: " in line:
            settings[line.split(" /")[0]] = json.loads(line.split(": ", 1)[1])
    assert set(settings) == {"grpo", "agrpo"}
    for s in settings.values():  # the A-GRPO README's training table (docs/methods.md 2.1)
        assert (s["model_name_or_path"], s["max_steps"], s["learning_rate"], s["lr_scheduler_type"],
                s["warmup_ratio"], s["beta"], s["num_generations"], s["max_prompt_length"],
                s["max_completion_length"], s["use_vllm"]) == ("Qwen/Qwen2.5-0.5B-Instruct", 450, 5e-7, "cosine",
                                                               0.03, 0.001, 8, 256, 1024, True)
        assert s["per_device_train_batch_size"] * s["gradient_accumulation_steps"] == 16
    assert settings["agrpo"]["adaptive_kl"] and settings["agrpo"]["kl_estimator"] == "symmetric"
    assert not settings["grpo"]["adaptive_kl"] and settings["grpo"]["kl_estimator"] == "k3"
    assert "python train_agrpo.py --algo agrpo --max_steps 450" in proc.stdout


@pytest.mark.slow
def test_tiny_ablation_runs_evaluates_writes_table_and_figures_and_resumes(tmp_path, tiny_model, capsys):
    out = tmp_path / "ablate"
    # on the tiny random model: the harness's mechanics (runs, evaluation, table, figures, resume), not its numbers
    command = ABLATE + ["--methods", "grpo", "--ablations", "full", "no_entropy", "--seeds", "3", "--max_steps", "3",
                        "--token_budget", "50", "--eval_samples", "6", "--eval_num_samples", "1",
                        "--output_dir", str(out), "--", "--max_completion_length", "16",
                        "--model_name_or_path", tiny_model]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "2 configurations x seeds, 1 distinct runs" in proc.stdout
    runs = list(csv.DictReader(open(out / "runs.csv")))
    assert [(r["ablation"], r["same_as"]) for r in runs] == [("full", ""), ("no_entropy", "grpo/full")]
    run = runs[0]
    # the budget (50 tokens) is spent by the first step's 16 completions: the run stops there, not at 3 steps
    assert run["steps"] == "1" and int(run["num_tokens"]) >= 50
    assert 0.0 <= float(run["win_rate"]) <= 1.0 and float(run["kl"]) >= 0.0 and 0 < float(run["length"]) <= 16
    assert 0.0 <= float(run["accuracy_start"]) <= 1.0 and run["win_rate"] == runs[1]["win_rate"]
    config = (out / "runs" / "grpo" / "full" / "seed3" / "config.yaml").read_text()
    assert "max_num_tokens: 50" in config and "num_eval_samples: 0" in config and "seed: 3" in config
    table = (out / "table.md").read_text()
    assert "| no_entropy (= grpo/full) | grpo |" in table and "| Win |" in table
    assert len(list(csv.DictReader(open(out / "table.csv")))) == 2
    for name in ["curves/grpo-full.png", "curves/full.png", "win_rate_bar.png", "win_rate_radar.png"]:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name

    # interrupted after training and before the evaluation: only the evaluation is done again. The script's main in
    # this process from here (the command line was run above; its runs are subprocesses either way)
    (out / "runs" / "grpo" / "full" / "seed3" / "eval.json").unlink()
    trained = (out / "runs" / "grpo" / "full" / "seed3" / "final" / "model.safetensors").stat().st_mtime_ns
    capsys.readouterr()
    ablate_main(command[2:])
    again = capsys.readouterr().out
    assert "[1/1] grpo / full / seed 3: evaluated in" in again and "trained" not in again
    assert (out / "runs" / "grpo" / "full" / "seed3" / "final" / "model.safetensors").stat().st_mtime_ns == trained
    assert list(csv.DictReader(open(out / "runs.csv")))[0]["win_rate"] == run["win_rate"]
    # the starting model's scores were kept by the first evaluation and read, not generated, by the second
    results = json.loads((out / "runs" / "grpo" / "full" / "seed3" / "eval.json").read_text())["results"]
    assert results[-1]["cached"] is True and "cached" not in results[0]
    # the per-device scheduler (one worker per id; CUDA_VISIBLE_DEVICES is ignored on a CPU) finds it all done
    ablate_main(["--devices", "0", "1"] + command[2:])
    assert "[1/1] grpo / full / seed 3: already done" in capsys.readouterr().out


def test_adaptive_entropy_ablation_and_no_entropy_under_it():
    """`adaptive_entropy` switches the controller on (docs/methods.md 2.6); `no_entropy` of a configuration that
    uses it switches it off too, or eta would climb again from 0."""
    agrpo = make_config({"algo": "agrpo"})
    assert ablation_overrides("adaptive_entropy", agrpo) == {"use_adaptive_entropy": True}
    adaptive = make_config({"algo": "agrpo", "use_adaptive_entropy": True})
    assert ablation_overrides("no_entropy", adaptive) == {"eta": 0.0, "use_adaptive_entropy": False}
    assert ablation_overrides("no_entropy", agrpo) == {"eta": 0.0}


def test_objective_ablations_and_chosen_pairs():
    """The objectives of docs/methods.md 1.7-1.11 as ablations, and `--configs`: only the pairs named, a pair the
    trainer refuses (A-GRPO moves a clip band SAPO has not) named before anything runs, a table without the rest."""
    grpo = resolved("grpo")
    assert ablation_overrides("cispo", grpo) == {"loss_type": "cispo", "epsilon_high": 5.0}
    assert ablation_overrides("cispo", resolved("grpo", "--epsilon_high", "4")) == {"loss_type": "cispo"}
    assert ablation_overrides("sapo", grpo) == {"loss_type": "sapo"}
    assert ablation_overrides("top_entropy", grpo) == {"top_entropy_quantile": 0.2}
    args, _ = parse_args(["--configs", "grpo/full", "grpo/sapo", "agrpo/adaptive_entropy", "grpo/sapo", "--jobs", "2"])
    assert args.pairs == [("grpo", "full"), ("grpo", "sapo"), ("agrpo", "adaptive_entropy")]
    assert (args.methods, args.ablations, args.jobs) == (["grpo", "agrpo"], ["full", "sapo", "adaptive_entropy"], 2)
    with pytest.raises(AblateError, match="--configs: grpo: give each as METHOD/ABLATION"):
        parse_args(["--configs", "grpo"])
    with pytest.raises(AblateError, match="--ablations: nope not known"):
        parse_args(["--configs", "grpo/nope"])
    with pytest.raises(AblateError, match="--jobs must be at least 1"):
        parse_args(["--jobs", "0"])
    jobs = plan(args.methods, args.ablations, [7], [], Path("/nonexistent"), 3, None, pairs=args.pairs)
    assert [(j.method, j.ablation) for j in jobs] == args.pairs
    assert jobs[1].cfg.loss_type == "sapo" and jobs[2].cfg.use_adaptive_entropy and jobs[2].cfg.adaptive_kl
    with pytest.raises(AblateError, match="agrpo / sapo / seed 7: .*sapo"):
        plan([], [], [7], [], Path("/nonexistent"), 3, None, pairs=[("agrpo", "sapo")])
    rows = [row("grpo", "full", 1, 0.5, 0.3), row("grpo", "sapo", 1, 0.6, 0.4), row("agrpo", "adaptive_entropy", 1,
                                                                                    0.55, 0.35)]
    text = table_markdown(aggregate(rows), args.methods, args.ablations)
    assert "| sapo | grpo |" in text and "| adaptive_entropy | agrpo |" in text
    assert "| full | agrpo |" not in text and "Differences to grpo" not in text  # no pair to compare


def test_cpu_jobs_share_the_cores_and_devices_get_one_gpu_each():
    assert run_env(None) is None
    assert run_env("cpu1", 2, cores=2)["OMP_NUM_THREADS"] == "1"
    assert run_env("cpu0", 3, cores=16)["OMP_NUM_THREADS"] == "5"
    assert run_env("cpu0", 4, cores=2)["OMP_NUM_THREADS"] == "1"
    assert run_env("3")["CUDA_VISIBLE_DEVICES"] == "3"
