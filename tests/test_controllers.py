"""Hand-computed values for the adaptive controllers in lib/methods/controllers.py (docs/methods.md 2.2, 4, 5), including the
upstream AGPO-DSF unit-test vectors; directions and bounds of every update; state round trips."""

import json
import math
from types import SimpleNamespace

import pytest

from lib.methods import controllers
from lib.config import make_config
from lib.methods.controllers import (ADAGRPO_SCHEDULE, DSFState, GroupSizeState, KLControllerState, dsf_clip_range,
                             dsf_clip_ranges, dsf_temperatures, dsf_uncertainty, init_kl_controller,
                             parse_resample_schedule, resample_plan, update_group_size, update_kl_controller,
                             update_step_kl, vote_entropy)


def agrpo_cfg(**overrides):
    return make_config({"algo": "agrpo", **overrides})


# ---- A-GRPO: beta_t and epsilon_t ------------------------------------------------------------------------------------

def test_kl_controller_hand_values():
    cfg = agrpo_cfg()  # beta 0.001, eps 0.2, target 0.05, decay 0.9, k_beta 0.1, k_eps 0.5
    state = init_kl_controller(cfg)
    assert state == KLControllerState(beta=0.001, epsilon=0.2, kl_ema=None)
    # first observation 0.06: K = 0.06 (no history), e = 0.06 / 0.05 - 1 = 0.2 (at the clip)
    state = update_kl_controller(state, 0.06, cfg)
    assert state.kl_ema == pytest.approx(0.06)
    assert state.beta == pytest.approx(0.001 * (1 + 0.1 * 0.2))
    assert state.epsilon == pytest.approx(0.2 * (1 - 0.5 * 0.2))
    # second observation 0.04: K = 0.9 * 0.06 + 0.1 * 0.04 = 0.058, e = 0.16
    state = update_kl_controller(state, 0.04, cfg)
    assert state.kl_ema == pytest.approx(0.058)
    assert state.beta == pytest.approx(0.001 * 1.02 * (1 + 0.1 * 0.16))
    assert state.epsilon == pytest.approx(0.2 * (1 - 0.5 * 0.16))  # from eps_0, not from the last eps


def test_kl_controller_directions_and_bounds():
    cfg = agrpo_cfg(beta=0.5)
    high = low = init_kl_controller(cfg)
    for _ in range(600):  # 0.98^600 * 0.5 is far below beta_min
        high = update_kl_controller(high, 1.0, cfg)  # KL far above target
        low = update_kl_controller(low, 0.0, cfg)  # far below
    assert high.beta == cfg.beta_max and high.epsilon == pytest.approx(0.2 * 0.9)  # shrinks the trust region
    assert low.beta == cfg.beta_min and low.epsilon == pytest.approx(0.2 * 1.1)  # widens it
    tight = agrpo_cfg(epsilon_min=0.19, epsilon_max=0.21)
    assert update_kl_controller(init_kl_controller(tight), 1.0, tight).epsilon == 0.19
    assert update_kl_controller(init_kl_controller(tight), 0.0, tight).epsilon == 0.21
    # an epsilon fixed by hand (the seeds' eps0.5 ablation) stays where the bounds are pinned at it; unpinned, the
    # first step would clip it back to epsilon_max 0.3, which is why lib/config.py refuses that setting
    pinned = agrpo_cfg(epsilon=0.5, epsilon_min=0.5, epsilon_max=0.5)
    assert [update_kl_controller(init_kl_controller(pinned), kl, pinned).epsilon for kl in (0.0, 1.0)] == [0.5, 0.5]


def test_group_size_controller_doubles_halves_and_stays_in_bounds():
    cfg = SimpleNamespace(group_size_min=4, group_size_max=16)
    state = update_group_size(GroupSizeState(num_generations=8), 0.8, cfg)  # EMA starts at the first value
    assert state == GroupSizeState(num_generations=16, zero_std_ema=0.8)
    assert update_group_size(state, 1.0, cfg).num_generations == 16  # at the cap
    # 0.9 * 0.8 + 0.1 * 0.0 = 0.72 > 0.5: still doubling pressure; the average moves slowly
    assert update_group_size(state, 0.0, cfg).zero_std_ema == pytest.approx(0.72)
    calm = update_group_size(GroupSizeState(num_generations=8), 0.05, cfg)
    assert calm.num_generations == 4
    assert update_group_size(calm, 0.0, cfg).num_generations == 4  # at the floor
    middle = update_group_size(GroupSizeState(num_generations=8), 0.3, cfg)
    assert middle.num_generations == 8


# ---- adaGRPO: the retry schedule -------------------------------------------------------------------------------------

def test_upstream_schedule_budgets_and_parameters():
    schedule = parse_resample_schedule(ADAGRPO_SCHEDULE)
    assert [len(t["params"]) for t in schedule] == [2, 4, 8, 16]
    assert resample_plan(schedule, 1, 0.7, 1.0) == [{"temperature": 1.0, "top_p": 1.0}] * 2
    assert resample_plan(schedule, 99, 0.7, 1.0) == resample_plan(schedule, 1, 0.7, 1.0)
    at_100 = resample_plan(schedule, 100, 0.7, 1.0)  # the trigger applies from its own step
    assert at_100[2:] == [{"temperature": 1.1, "top_p": 0.99}] * 2
    late = resample_plan(schedule, 700, 0.7, 1.0)
    assert late[-1] == {"temperature": 1.3, "top_p": 0.97} and len(late) == 16
    # before the first trigger: no retries; keys a retry does not set keep the run's own values
    assert resample_plan([{"step": 5, "params": [{"top_p": 0.9}]}], 4, 0.7, 1.0) == []
    assert resample_plan([{"step": 5, "params": [{"top_p": 0.9}]}], 5, 0.7, 1.0) == [{"temperature": 0.7,
                                                                                      "top_p": 0.9}]


@pytest.mark.parametrize("schedule, message", [
    ([{"step": 0, "params": []}], "step must be an integer >= 1"),
    ([{"step": 1}], "exactly the keys"),
    ([{"step": 1, "params": [{"top_k": 5}]}], "may set only temperature, top_p"),
    ([{"step": 1, "params": [{"temperature": 0}]}], "temperature > 0"),
    ([{"step": 1, "params": {"temperature": 1.0}}], "one mapping per retry"),
])
def test_bad_schedules_name_the_entry(schedule, message):
    with pytest.raises(ValueError, match=message):
        parse_resample_schedule(schedule)


# ---- AGPO-DSF --------------------------------------------------------------------------------------------------------

def dsf_cfg(**overrides):
    return make_config({"algo": "agpo_dsf", "temperature": 1.0, **overrides})


def test_dsf_upstream_vectors():
    # upstream tests/train/test_agpo_trainer.py: centred(2.0, ema 1.0, alpha 0.25) -> c = 1.0, baseline 1.25
    cfg = dsf_cfg(dsf_ema_alpha=0.25, dsf_lambda_temp=0.2)
    state, temps, centred = dsf_temperatures(DSFState(uncertainty_baseline=1.0), [2.0], cfg)
    assert centred[0] == pytest.approx(1.0) and state.uncertainty_baseline == pytest.approx(1.25)
    # tau(1.0, lambda 0.2, c 1) = 1.2
    assert temps[0] == pytest.approx(1.2)
    # eps(0.2, sigma .4, |kappa| .3, H 1.5, H_ref 1.0, E .7, KL .2, alpha 1, gamma .5, delta .1, zeta .2, h in [.5, 2])
    # = 0.2 * 1.5 * 1.07 / 1.56 = 0.2058
    clip = dsf_cfg(dsf_alpha_var=1.0, dsf_gamma_stepkl=0.5, dsf_delta_probe_entropy=0.1, dsf_zeta_skew=0.2,
                   dsf_entropy_h_min=0.5, dsf_entropy_h_max=2.0)
    eps = dsf_clip_range(entropy=1.5, entropy_ref=1.0, dispersion=0.4, vote=0.7, skewness=-0.3, step_kl=0.2, cfg=clip)
    assert eps == pytest.approx(0.2 * 1.5 * 1.07 / 1.56, rel=1e-6) and round(eps, 4) == 0.2058


def test_dsf_temperature_first_prompt_sets_the_baseline_and_heats_or_cools():
    cfg = dsf_cfg()  # tau_base 1.0, lambda 0.15, alpha 0.1, tau in [0.5, 1.5]
    state, temps, centred = dsf_temperatures(DSFState(), [0.8, 1.6, 0.4, 50.0], cfg)
    # prompt 1 initialises: c 0, tau 1.0, baseline 0.8; prompt 2: c = (1.6 - 0.8) / 0.8 = 1 -> tau 1.15, baseline
    # 0.1 * 1.6 + 0.9 * 0.8 = 0.88; prompt 3: c = (0.4 - 0.88) / 0.88 -> cooler; prompt 4: far above -> tau_max
    assert centred[:2] == pytest.approx([0.0, 1.0])
    assert temps[:2] == pytest.approx([1.0, 1.15])
    assert centred[2] == pytest.approx((0.4 - 0.88) / 0.88) and temps[2] < 1.0
    assert temps[3] == cfg.dsf_tau_max
    assert state.uncertainty_baseline == pytest.approx(0.1 * 50.0 + 0.9 * (0.1 * 0.4 + 0.9 * 0.88))
    cold, temps_cold, _ = dsf_temperatures(DSFState(uncertainty_baseline=10.0), [0.0], dsf_cfg(dsf_lambda_temp=5.0))
    assert temps_cold == [cfg.dsf_tau_min]


def test_dsf_clip_ranges_move_the_entropy_reference_in_order_and_respect_bounds():
    cfg = dsf_cfg()  # eps 0.2, h in [0.5, 1.5], alpha_var 1, gamma 0.5, delta 0.1, zeta 0, H-bar weight 0.01
    state, ranges = dsf_clip_ranges(DSFState(), [2.0, 3.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0], cfg)
    # group 1: no reference yet, H_ref = H -> g 1 -> eps 0.2; H-bar <- 2.0; group 2: g = 3 / 2 = 1.5 -> 0.3
    assert ranges == pytest.approx([0.2, 0.3], rel=1e-6)
    assert state.entropy_ref == pytest.approx(0.01 * 3.0 + 0.99 * 2.0)
    # more reward spread and drift narrow it, down to eps_min; disagreeing probe answers widen it, up to eps_max
    assert dsf_clip_range(1.0, 1.0, dispersion=0.5, vote=0.0, skewness=0.0, step_kl=0.0, cfg=cfg) < 0.2
    assert dsf_clip_range(1.0, 1.0, dispersion=0.0, vote=2.0, skewness=0.0, step_kl=0.0, cfg=cfg) > 0.2
    assert dsf_clip_range(0.1, 1.0, dispersion=9.0, vote=0.0, skewness=0.0, step_kl=9.0, cfg=cfg) == cfg.dsf_eps_min
    assert dsf_clip_range(9.0, 1.0, dispersion=0.0, vote=99.0, skewness=0.0, step_kl=0.0, cfg=cfg) == cfg.dsf_eps_max
    # the last update's drift enters through the state
    drifted = DSFState(entropy_ref=1.0, step_kl_ema=0.4)
    _, (narrow,) = dsf_clip_ranges(drifted, [1.0], [0.0], [0.0], [0.0], cfg)
    assert narrow == pytest.approx(0.2 / (1 + 0.5 * 0.4))


def test_dsf_step_kl_average_and_uncertainty_and_vote_entropy():
    cfg = dsf_cfg()
    state = update_step_kl(DSFState(), 0.5, cfg)
    assert state.step_kl_ema == pytest.approx(0.05)  # 0.1 * 0.5 + 0.9 * 0
    assert update_step_kl(state, 0.0, cfg).step_kl_ema == pytest.approx(0.045)
    # U = w_r sigma + w_e E + w_k |kappa|; skewness has no weight by default (upstream w_k = 0)
    assert dsf_uncertainty(0.5, 0.7, -3.0, cfg) == pytest.approx(1.2)
    assert dsf_uncertainty(0.5, 0.7, -3.0, dsf_cfg(dsf_w_k=0.1)) == pytest.approx(1.5)
    assert vote_entropy(["7", "7", "7", "7"]) == 0.0
    assert vote_entropy(["7", "7", "8", "9"]) == pytest.approx(-(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25)))
    assert vote_entropy(["1", "2", "3", "4"]) == pytest.approx(math.log(4))
    assert vote_entropy([]) == 0.0


def test_states_round_trip_through_json_exactly():
    for state in (KLControllerState(beta=0.0009803921568627451, epsilon=0.22, kl_ema=0.030517578125),
                  GroupSizeState(num_generations=16, zero_std_ema=0.7290000000000001),
                  DSFState(uncertainty_baseline=1.3039, entropy_ref=1.6587330341339111, step_kl_ema=0.0919)):
        text = json.dumps(controllers.to_dict(state))
        assert controllers.from_dict(type(state), json.loads(text)) == state
    with pytest.raises(ValueError, match="unknown fields"):
        controllers.from_dict(DSFState, {"temperature": 1.0})


# ---- adaptive entropy control (Skywork-OR1; TRL's use_adaptive_entropy) ----------------------------------------------

def test_entropy_controller_hand_values_and_bounds():
    """c moves by delta toward keeping e at the target, within [min, max]; the bonus weight is c while the last
    measured e is at or below the target, 0 above it and before any measurement (docs/methods.md 2.6)."""
    cfg = SimpleNamespace(eta=0.01, entropy_target=0.2, entropy_coef_delta=0.005, entropy_coef_min=0.0,
                          entropy_coef_max=0.02)
    state = controllers.init_entropy_controller(cfg)
    assert state == controllers.EntropyControllerState(eta=0.01, entropy=None)
    assert controllers.entropy_bonus_weight(state, cfg) == 0.0  # nothing measured yet (TRL: +inf)
    state = controllers.update_entropy_controller(state, 0.1, cfg)  # below the target: up
    assert state.eta == pytest.approx(0.015) and controllers.entropy_bonus_weight(state, cfg) == state.eta
    state = controllers.update_entropy_controller(state, 0.2, cfg)  # at the target counts as below
    state = controllers.update_entropy_controller(state, 0.2, cfg)
    assert state.eta == 0.02  # capped at entropy_coef_max
    state = controllers.update_entropy_controller(state, 0.3, cfg)  # above: down, and no bonus
    assert state.eta == pytest.approx(0.015) and controllers.entropy_bonus_weight(state, cfg) == 0.0
    for _ in range(5):
        state = controllers.update_entropy_controller(state, 0.3, cfg)
    assert state.eta == 0.0  # floored at entropy_coef_min
    assert controllers.from_dict(controllers.EntropyControllerState,
                                 json.loads(json.dumps(controllers.to_dict(state)))) == state


def test_entropy_controller_matches_trls_grpo_trainer_over_steps():
    """TRL's GRPOTrainer._compute_loss with use_adaptive_entropy, five optimizer steps of one micro-batch each (its
    model pass replaced by our log-probs and entropies): the same loss and gradients (policy term plus the bonus the
    controller applies) and the same coefficient after every step as EntropyController in front of
    policy_loss + aggregate_loss (loss_type dapo, whose token mean is TRL's bonus normalisation)."""
    from collections import defaultdict

    import torch

    from lib.methods.losses import aggregate_loss, policy_loss
    from lib.methods.registry import EntropyController, TrainValues

    trainer_module = pytest.importorskip("trl.trainer.grpo_trainer")
    cfg = SimpleNamespace(eta=0.02, entropy_target=0.2, entropy_coef_delta=0.05, entropy_coef_min=0.0,
                          entropy_coef_max=0.08)
    ours = EntropyController(cfg)
    args = SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1,
                           entropy_target=cfg.entropy_target, entropy_coef_delta=cfg.entropy_coef_delta,
                           entropy_coef_min=cfg.entropy_coef_min, entropy_coef_max=cfg.entropy_coef_max)
    trainer = SimpleNamespace(
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level="token", beta=0.0, loss_type="dapo", epsilon_low=0.2, epsilon_high=0.2,
        use_vllm=False, _entropy_bonus_enabled=True, use_adaptive_entropy=True, entropy_coef=cfg.eta,
        _last_world_entropy=float("inf"), _entropy_window_stats=None, current_gradient_accumulation_steps=1,
        args=args, model=SimpleNamespace(training=True), _metrics=defaultdict(lambda: defaultdict(list)),
        accelerator=SimpleNamespace(num_processes=1, gather=lambda x: x, reduce=lambda x, reduction: x,
                                    sync_gradients=True))
    generator = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.float32)  # padding included
    adv = torch.tensor([0.7, -1.1, 0.4])  # both signs
    applied = []
    for scale in (0.3, 0.1, 0.15, 0.5, 0.05):  # the steps' entropies around the 0.2 target
        logp = (-torch.rand(3, 4, generator=generator)).requires_grad_()
        entropy = (scale * 2 * torch.rand(3, 4, generator=generator)).requires_grad_()
        old = logp.detach() - 0.05 * torch.randn(3, 4, generator=generator)
        eta = ours.step_values(TrainValues(0.0, 0.2, 0.2, cfg.eta)).eta
        applied.append(eta)
        per_token, _ = policy_loss("dapo", logp, old, adv, mask, 0.2, 0.2)
        loss = aggregate_loss(per_token - eta * entropy, mask, "dapo", global_num_sequences=3,
                              global_num_tokens=mask.sum(), max_completion_length=4)
        loss.backward()
        ours.after_step({"entropy/trained": float((entropy.detach() * mask).sum() / mask.sum())})

        leaf, leaf_entropy = logp.detach().clone().requires_grad_(), entropy.detach().clone().requires_grad_()
        trainer._get_per_token_logps_and_entropies = lambda *a, **k: (leaf, leaf_entropy, None)
        inputs = {"prompt_ids": torch.zeros(3, 2, dtype=torch.long), "prompt_mask": torch.ones(3, 2, dtype=torch.long),
                  "completion_ids": torch.zeros(3, 4, dtype=torch.long), "completion_mask": mask,
                  "advantages": adv, "old_per_token_logps": old, "num_items_in_batch": mask.sum()}
        theirs = trainer_module.GRPOTrainer._compute_loss(trainer, None, inputs)
        theirs.backward()
        assert torch.allclose(loss, theirs, atol=1e-7)
        assert torch.allclose(logp.grad, leaf.grad, atol=1e-7) and torch.allclose(entropy.grad, leaf_entropy.grad)
        assert ours.state.eta == pytest.approx(trainer.entropy_coef, abs=1e-12)
        assert ours.metrics()["entropy_coef"] == pytest.approx(trainer._metrics["train"]["entropy_coef"][-1])
    assert applied == pytest.approx([0.0, 0.0, 0.05, 0.08, 0.0])  # the bonus acted, and was held back, both


@pytest.mark.parametrize("loss_type", ["bnpo", "dapo"])
def test_entropy_controller_matches_trl_under_gradient_accumulation(loss_type):
    """Three optimizer steps of two accumulated micro-batches with different token counts. The coefficient after
    every step is TRL's (both measure the entropy over the whole window's tokens). TRL adds the bonus as each
    micro-batch's token mean / accumulation steps; so does our bnpo, whose loss and gradients are then TRL's. Our dapo
    (A-GRPO's preset) averages the bonus over the window's tokens like its policy term: the loss differs from TRL's
    by exactly eta (mean of the micro-batch means - the window's token mean), on purpose (docs/methods.md 2.6)."""
    from collections import defaultdict

    import torch

    from lib.methods.losses import aggregate_loss, policy_loss
    from lib.methods.registry import EntropyController, TrainValues

    trainer_module = pytest.importorskip("trl.trainer.grpo_trainer")
    cfg = SimpleNamespace(eta=0.03, entropy_target=0.25, entropy_coef_delta=0.02, entropy_coef_min=0.0,
                          entropy_coef_max=1.0)
    ours = EntropyController(cfg)
    trainer = SimpleNamespace(
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level="token", beta=0.0, loss_type=loss_type, epsilon_low=0.2, epsilon_high=0.2,
        use_vllm=False, _entropy_bonus_enabled=True, use_adaptive_entropy=True, entropy_coef=cfg.eta,
        _last_world_entropy=float("inf"), _entropy_window_stats=None, current_gradient_accumulation_steps=2,
        args=SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=2,
                             entropy_target=cfg.entropy_target, entropy_coef_delta=cfg.entropy_coef_delta,
                             entropy_coef_min=cfg.entropy_coef_min, entropy_coef_max=cfg.entropy_coef_max),
        model=SimpleNamespace(training=True), _metrics=defaultdict(lambda: defaultdict(list)),
        accelerator=SimpleNamespace(num_processes=1, gather=lambda x: x, reduce=lambda x, reduction: x,
                                    sync_gradients=False))
    generator = torch.Generator().manual_seed(3)
    masks = [torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.float32),
             torch.tensor([[1, 0, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.float32)]
    window_tokens = sum(m.sum() for m in masks)
    adv = torch.tensor([0.9, -0.6, -0.3])
    applied = []
    for scale in (0.1, 0.1, 0.4):
        eta = ours.step_values(TrainValues(0.0, 0.2, 0.2, cfg.eta)).eta
        applied.append(eta)
        measured, means = 0.0, []
        for m, mask in enumerate(masks):
            logp = (-torch.rand(3, 4, generator=generator)).requires_grad_()
            entropy = (scale * 2 * torch.rand(3, 4, generator=generator)).requires_grad_()
            old = logp.detach() - 0.05 * torch.randn(3, 4, generator=generator)
            per_token, _ = policy_loss(loss_type, logp, old, adv, mask, 0.2, 0.2)
            loss = aggregate_loss(per_token - eta * entropy, mask, loss_type, global_num_sequences=6,
                                  global_num_tokens=window_tokens, max_completion_length=4,
                                  gradient_accumulation_steps=2)
            loss.backward()
            measured += float((entropy.detach() * mask).sum())
            means.append(float((entropy.detach() * mask).sum() / mask.sum()))

            leaf, leaf_entropy = logp.detach().clone().requires_grad_(), entropy.detach().clone().requires_grad_()
            trainer._get_per_token_logps_and_entropies = lambda *a, **k: (leaf, leaf_entropy, None)
            trainer.accelerator.sync_gradients = m == len(masks) - 1  # the window's last micro-batch
            inputs = {"prompt_ids": torch.zeros(3, 2, dtype=torch.long),
                      "prompt_mask": torch.ones(3, 2, dtype=torch.long),
                      "completion_ids": torch.zeros(3, 4, dtype=torch.long), "completion_mask": mask,
                      "advantages": adv, "old_per_token_logps": old, "num_items_in_batch": window_tokens}
            theirs = trainer_module.GRPOTrainer._compute_loss(trainer, None, inputs)
            theirs.backward()
            if loss_type == "bnpo":
                assert torch.allclose(loss, theirs, atol=1e-7)
                assert torch.allclose(entropy.grad, leaf_entropy.grad, atol=1e-9)
            else:
                bonus_ours = eta * (entropy.detach() * mask).sum() / window_tokens
                bonus_theirs = eta * means[-1] / 2
                gap = float((loss - theirs).detach())
                assert gap == pytest.approx(float(bonus_theirs - bonus_ours), abs=1e-7)
                assert eta == 0 or abs(gap) > 1e-4  # the micro-batches' token counts differ: so do the means
            assert torch.allclose(logp.grad, leaf.grad, atol=1e-7)
        ours.after_step({"entropy/trained": measured / float(window_tokens)})
        assert ours.state.eta == pytest.approx(trainer.entropy_coef, abs=1e-12)
    assert applied == pytest.approx([0.0, 0.05, 0.07])  # the bonus acted with two different weights


def test_every_controller_passes_on_the_values_it_does_not_set():
    """Each controller's step_values changes only its own values: the entropy weight reaches the loss under A-GRPO's
    KL controller and AGPO-DSF's per-group clip, and the clip and beta under the entropy controller."""
    import torch

    from lib.methods.registry import Controllers, DSFController, EntropyController, KLController, TrainValues

    cfg = make_config({"algo": "agpo_dsf", "adaptive_kl": True, "beta": 0.03, "eta": 0.01})
    dsf = DSFController(cfg)
    dsf.ranges = torch.tensor([0.1, 0.3])
    values = Controllers([KLController(cfg), dsf]).step_values(TrainValues(0.03, 0.2, 0.2, 0.01))
    assert values.eta == 0.01 and values.epsilon_low.tolist() == pytest.approx([0.1, 0.3])
    entropy = EntropyController(make_config({"use_adaptive_entropy": True, "eta": 0.01}))
    entropy.state = controllers.EntropyControllerState(eta=0.02, entropy=0.1)
    assert entropy.step_values(TrainValues(0.04, 0.2, 0.28, 0.01)) == TrainValues(0.04, 0.2, 0.28, 0.02)
