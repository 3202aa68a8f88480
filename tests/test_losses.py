"""Hand-computed values for the GRPO math in lib/methods/losses.py (docs/methods.md section 1)."""

import math

import pytest
import torch

from conftest import assert_close_to_scale, assert_rel_close
from lib.methods.losses import (aggregate_loss, clipped_surrogate, dispersion, group_advantages, group_skewness, kl_penalty,
                        high_entropy_mask, off_policy_sequence_mask,
                        LOSS_TYPES, ObjectiveSettings, ObjectiveStats, policy_loss, policy_objective,
                        normalize_then_sum, truncated_importance_weights, weighted_rewards,
                        token_logps_and_entropy)


def test_group_advantages_group_scaling_matches_hand_values():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    adv, stats = group_advantages(rewards, group_size=4, scale_rewards="group")
    # group 1: mean 0.25, unbiased std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5
    # group 2: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735
    s2 = math.sqrt(1 / 3)
    expected = [0.75 / 0.5001, -0.25 / 0.5001, -0.25 / 0.5001, -0.25 / 0.5001,
                0.5 / (s2 + 1e-4), 0.5 / (s2 + 1e-4), -0.5 / (s2 + 1e-4), -0.5 / (s2 + 1e-4)]
    assert adv.tolist() == pytest.approx(expected, rel=1e-5)
    assert float(stats["reward_std"]) == pytest.approx((0.5 + s2) / 2, rel=1e-5)
    assert float(stats["frac_reward_zero_std"]) == 0.0


def test_group_advantages_batch_and_none_scaling():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    # batch: three 1s and five 0s, mean 0.375, unbiased var (3 * 0.625^2 + 5 * 0.375^2) / 7 = 1.875 / 7
    std_b = math.sqrt(1.875 / 7)
    adv, _ = group_advantages(rewards, 4, "batch")
    assert adv[0].item() == pytest.approx(0.75 / (std_b + 1e-4), rel=1e-5)
    assert adv[6].item() == pytest.approx(-0.5 / (std_b + 1e-4), rel=1e-5)
    adv, _ = group_advantages(rewards, 4, "none")  # Dr. GRPO: centred only
    assert adv.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5])


def test_homogeneous_group_gets_zero_advantage_and_is_counted():
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    adv, stats = group_advantages(rewards, 4, "group")
    assert adv[:4].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert float(stats["frac_reward_zero_std"]) == 0.5
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(rewards, 3)
    with pytest.raises(ValueError, match="scale_rewards"):
        group_advantages(rewards, 4, "groups")


def test_clipped_surrogate_token_level_values_and_gradients():
    old = torch.zeros(1, 4)
    # ratios 1.5, 0.5, 1.1, 1.25
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1, 1.25]])).requires_grad_()
    mask = torch.ones(1, 4)
    per_token, stats = clipped_surrogate(logp, old, torch.tensor([1.0]), mask, 0.2, 0.2)
    # A = +1: -min(rho, clip(rho)) -> -1.2 (clipped), -0.5, -1.1, -1.2 (clipped)
    assert per_token[0].tolist() == pytest.approx([-1.2, -0.5, -1.1, -1.2], rel=1e-6)
    per_token.sum().backward()
    # clipped tokens get no gradient; unclipped get -rho (d(-rho)/dlogp)
    assert logp.grad[0].tolist() == pytest.approx([0.0, -0.5, -1.1, 0.0], rel=1e-6)
    assert float(stats["clip_ratio/high_mean"]) == 0.5
    assert float(stats["clip_ratio/low_mean"]) == 0.0

    # DAPO clip-higher: epsilon_high 0.28 leaves 1.25 unclipped; A = -1 clips the low side
    logp2 = torch.log(torch.tensor([[1.5, 0.5, 1.1, 1.25]]))
    per_token, _ = clipped_surrogate(logp2, old, torch.tensor([1.0]), mask, 0.2, 0.28)
    assert per_token[0, 3].item() == pytest.approx(-1.25)
    per_token, stats = clipped_surrogate(logp2, old, torch.tensor([-1.0]), mask, 0.2, 0.28)
    # A = -1: -min(-rho, -clip(rho)) = max(rho, clip(rho)) -> 1.5, 0.8 (0.5 clipped up to 0.8), 1.1, 1.25
    assert per_token[0].tolist() == pytest.approx([1.5, 0.8, 1.1, 1.25], rel=1e-6)
    assert float(stats["clip_ratio/low_mean"]) == 0.25


def test_on_policy_ratio_is_one_and_gradient_is_minus_advantage():
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    per_token, stats = clipped_surrogate(logp, logp.detach(), torch.tensor([0.7]), torch.ones(1, 3), 0.2, 0.2)
    assert per_token.tolist()[0] == pytest.approx([-0.7] * 3)
    per_token.sum().backward()
    assert logp.grad.tolist()[0] == pytest.approx([-0.7] * 3)
    assert float(stats["clip_ratio/region_mean"]) == 0.0


def test_sequence_level_ratio_gspo():
    old = torch.zeros(1, 3)
    logp = torch.tensor([[0.1, 0.3, 5.0]], requires_grad=True)  # the third token is padding
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    per_token, _ = clipped_surrogate(logp, old, torch.tensor([1.0]), mask, 0.3, 0.3, "sequence")
    s = math.exp(0.2)  # exp(mean of 0.1 and 0.3) = 1.2214, inside 1 +- 0.3
    assert per_token[0, :2].tolist() == pytest.approx([-s, -s], rel=1e-6)
    (per_token * mask).sum().backward()
    # d/dlogp_t of -2 s with s = exp(mean): -2 s / 2 for each real token, 0 for padding
    assert logp.grad[0].tolist() == pytest.approx([-s, -s, 0.0], rel=1e-6)
    per_token, _ = clipped_surrogate(logp.detach(), old, torch.tensor([1.0]), mask, 0.2, 0.2, "sequence")
    assert per_token[0, 0].item() == pytest.approx(-1.2)  # 1.2214 clipped to 1.2
    with pytest.raises(ValueError, match="importance_sampling_level"):
        clipped_surrogate(logp, old, torch.tensor([1.0]), mask, 0.2, 0.2, "group")


def test_kl_estimators_hand_values():
    logp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-0.5, -2.0]])  # log u = 0.5 and 0
    u = math.exp(0.5)
    assert kl_penalty(logp, ref, "k3")[0].tolist() == pytest.approx([u - 0.5 - 1, 0.0], abs=1e-6)
    assert kl_penalty(logp, ref, "k1")[0].tolist() == pytest.approx([-0.5, 0.0], abs=1e-6)
    assert kl_penalty(logp, ref, "forward")[0].tolist() == pytest.approx([u * 0.5 - u + 1, 0.0], abs=1e-6)
    assert kl_penalty(logp, ref, "symmetric")[0, 0].item() == pytest.approx((u - 1.5) + (0.5 * u - u + 1), rel=1e-6)
    with pytest.raises(ValueError, match="estimator"):
        kl_penalty(logp, ref, "k2")


def test_k3_gradient_pulls_policy_towards_reference():
    logp = torch.tensor([-1.0], requires_grad=True)
    kl_penalty(logp, torch.tensor([-0.5]), "k3").sum().backward()
    # d/dlogp (e^(r-l) - (r-l) - 1) = -e^(r-l) + 1 = 1 - e^0.5 < 0: descending raises logp towards ref
    assert logp.grad.item() == pytest.approx(1 - math.exp(0.5))


PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])


@pytest.mark.parametrize("loss_type, expected", [
    ("grpo", ((1 + 2 + 3) / 3 + 4 / 1) / 2),  # mean over sequences of the per-sequence token mean
    ("bnpo", (1 + 2 + 3 + 4) / 4),  # token mean of the micro-batch
    ("dapo", (1 + 2 + 3 + 4) / 4),  # token mean of the global batch (here the same batch)
    ("dr_grpo", (1 + 2 + 3 + 4) / (2 * 8)),  # sum over N x max_completion_length
])
def test_aggregate_loss_hand_values(loss_type, expected):
    loss = aggregate_loss(PER_TOKEN, MASK, loss_type, global_num_sequences=2, global_num_tokens=4,
                          max_completion_length=8)
    assert loss.item() == pytest.approx(expected)


def test_aggregate_loss_rejects_unknown_type():
    with pytest.raises(ValueError, match="loss_type"):
        aggregate_loss(PER_TOKEN, MASK, "token_mean", global_num_sequences=2, global_num_tokens=4,
                       max_completion_length=8)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_one_batch_equals_two_accumulated_half_batches(loss_type):
    """Gradient of the full batch B == sum of the gradients of two micro-batches of B/2 (and of two processes
    that DDP averages), because the normaliser is the global one."""
    torch.manual_seed(0)
    logits = torch.randn(4, 6, 11, requires_grad=True)  # stands in for the model: 4 completions, 6 tokens, V=11
    tokens = torch.randint(0, 11, (4, 6))
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0]]).float()
    adv = torch.tensor([1.0, -0.5, 0.3, -0.8])
    ref = torch.randn(4, 6) - 2.0
    n_tokens = mask.sum()

    def loss_of(rows, **kw):
        logp = torch.log_softmax(logits[rows], -1).gather(-1, tokens[rows, :, None]).squeeze(-1)
        per_token, _ = clipped_surrogate(logp, logp.detach(), adv[rows], mask[rows], 0.2, 0.2)
        per_token = per_token + 0.04 * kl_penalty(logp, ref[rows])
        return aggregate_loss(per_token, mask[rows], loss_type, global_num_sequences=4, global_num_tokens=n_tokens,
                              max_completion_length=6, **kw)

    loss_of(slice(0, 4)).backward()
    full = logits.grad.clone()
    logits.grad = None
    loss_of(slice(0, 2), gradient_accumulation_steps=2).backward()
    loss_of(slice(2, 4), gradient_accumulation_steps=2).backward()
    # equal to rounding (the halves sum in another order; tests/conftest.py); each half normalised by its own tokens or
    # sequences instead of the global count gives a relative difference of 1.0
    assert_rel_close(logits.grad, full, 1e-5, "accumulated gradient")
    # two processes of B/2 each: every process scales by num_processes, DDP averages the two gradients
    logits.grad = None
    loss_of(slice(0, 2), num_processes=2).backward()
    g0 = logits.grad.clone()
    logits.grad = None
    loss_of(slice(2, 4), num_processes=2).backward()
    assert_rel_close((g0 + logits.grad) / 2, full, 1e-5, "DDP-averaged gradient")


def test_bnpo_depends_on_the_split_like_trl():
    """bnpo normalises per micro-batch (TRL 0.17-0.21): documented as the one split-dependent type."""
    full = aggregate_loss(PER_TOKEN, MASK, "bnpo", global_num_sequences=2, global_num_tokens=4, max_completion_length=8)
    halves = sum(aggregate_loss(PER_TOKEN[i:i + 1], MASK[i:i + 1], "bnpo", global_num_sequences=2, global_num_tokens=4,
                                max_completion_length=8, gradient_accumulation_steps=2) for i in range(2))
    assert full.item() == pytest.approx(2.5)
    assert halves.item() == pytest.approx((2.0 + 4.0) / 2)


def test_chunked_logps_match_full_log_softmax_with_per_token_temperature():
    torch.manual_seed(1)
    hidden = torch.randn(7, 5, requires_grad=True)
    head = torch.nn.Linear(5, 13, bias=False)
    ids = torch.randint(0, 13, (7,))
    temps = torch.tensor([1.0, 0.7, 1.3, 1.0, 0.5, 2.0, 1.0])
    logp, entropy = token_logps_and_entropy(hidden, head, ids, temps, chunk_elements=3 * 13)
    full = torch.log_softmax(head(hidden) / temps[:, None], -1)
    # chunks of 3 rows against all 7 at once: another matmul shape, so equal to rounding, which differs between
    # CPUs' kernels (tests/conftest.py): up to 3e-7 of the scale measured; a row at another row's temperature is off
    # by 0.12 of the scale
    assert_close_to_scale(logp, full.gather(1, ids[:, None]).squeeze(1), 1e-5, "log-probs")
    assert_close_to_scale(entropy, -(full.exp() * full).sum(-1), 1e-5, "entropies")
    logp.sum().backward()
    chunked_grad = hidden.grad.clone()
    hidden.grad = None
    full.gather(1, ids[:, None]).sum().backward()
    assert_rel_close(chunked_grad, hidden.grad, 1e-5, "gradient")
    one_chunk, _ = token_logps_and_entropy(hidden, head, ids, temps)  # all rows in one chunk, no recompute
    assert_close_to_scale(one_chunk, logp, 1e-5, "one chunk")


# ---- adaptive-method parts (docs/methods.md 2-5) --------------------------------------------------------------------

def test_dispersion_std_mad_iqr_hand_values_and_robust_fallback():
    values = torch.tensor([[1.0, 2.0, 3.0, 4.0, 10.0]])
    # std: mean 4, squared deviations 9+4+1+0+36 = 50, / 4 -> 12.5
    assert dispersion(values, "std", dim=1).item() == pytest.approx(math.sqrt(12.5))
    # mad: median 3, |r - 3| = 2,1,0,1,7 -> median 1, times 1.4826
    assert dispersion(values, "mad", dim=1).item() == pytest.approx(1.4826)
    # iqr: q25 = 2, q75 = 4 (linear interpolation on 5 points), (4 - 2) / 1.349
    assert dispersion(values, "iqr", dim=1).item() == pytest.approx(2 / 1.349)
    # one correct answer among wrong ones: MAD and IQR are 0, so the std (0.5) is used, as AGPO-DSF does
    lone = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    assert dispersion(lone, "mad", dim=1).item() == pytest.approx(0.5)
    # IQR of [1, 0, 0, 0]: q75 interpolates to 0.25; of one 1 among eight it is 0 -> the std, sqrt(1/8)
    assert dispersion(lone, "iqr", dim=1).item() == pytest.approx(0.25 / 1.349)
    assert dispersion(torch.tensor([[1.0] + [0.0] * 7]), "iqr", dim=1).item() == pytest.approx(math.sqrt(1 / 8))
    # NaN entries (absent resampling rounds) are left out
    assert dispersion(torch.tensor([[1.0, float("nan"), 3.0]]), "std", dim=1).item() == pytest.approx(math.sqrt(2))
    with pytest.raises(ValueError, match="dispersion"):
        dispersion(values, "var")


def test_mixed_scaling_is_the_weighted_sum_of_group_and_batch():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    by_group, _ = group_advantages(rewards, 4, "group")
    by_batch, _ = group_advantages(rewards, 4, "batch")
    mixed, _ = group_advantages(rewards, 4, "mix", mix_weight=0.25)
    assert torch.allclose(mixed, 0.25 * by_group + 0.75 * by_batch)


def test_adagrpo_pooled_statistics_upstream_vector():
    # docs/methods.md 4.1: first round [-2, -2, -2, -2], the retry [5, -2, -2, -2]; pooled mean -1.125, pooled unbiased
    # std sqrt((7 * 0.875^2 + 6.125^2) / 7) = 2.4749 -> A = [2.47, -0.35, -0.35, -0.35] (plain GRPO: [1.5, -0.5, ...])
    last = torch.tensor([5.0, -2.0, -2.0, -2.0])
    pooled = torch.tensor([[-2.0, -2.0, -2.0, -2.0, 5.0, -2.0, -2.0, -2.0]])
    adv, _ = group_advantages(last, 4, "group", pooled=pooled)
    assert adv.tolist() == pytest.approx([6.125 / (2.474874 + 1e-4), -0.875 / (2.474874 + 1e-4),
                                          -0.875 / (2.474874 + 1e-4), -0.875 / (2.474874 + 1e-4)], rel=1e-5)
    assert [round(a, 2) for a in adv.tolist()] == [2.47, -0.35, -0.35, -0.35]
    plain, _ = group_advantages(last, 4, "group")
    assert plain.tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5], rel=1e-3)
    # a prompt that was not resampled has NaN in the extra round: its statistics are its own group's
    two = torch.tensor([1.0, 0.0, 0.0, 0.0, 5.0, -2.0, -2.0, -2.0])
    pool = torch.tensor([[1.0, 0.0, 0.0, 0.0] + [float("nan")] * 4, [-2.0] * 4 + [5.0, -2.0, -2.0, -2.0]])
    adv2, _ = group_advantages(two, 4, "group", pooled=pool)
    assert adv2[:4].tolist() == pytest.approx(group_advantages(two[:4], 4, "group")[0].tolist())
    assert adv2[4:].tolist() == pytest.approx(adv.tolist())


def test_agpo_homogeneous_groups_get_plus_minus_one_judged_on_correctness():
    # rewards = accuracy + a length term: no group has equal totals, but groups 1 and 2 are homogeneous in accuracy
    rewards = torch.tensor([1.2, 1.0, 0.8, 1.1, -0.1, 0.0, -0.3, -0.2, 1.0, 0.0, 0.0, 0.0])
    correct = torch.tensor([1, 1, 1, 1, 0, 0, 0, 0, 1, 0, 0, 0], dtype=torch.bool)
    adv, _ = group_advantages(rewards, 4, "group", correct=correct, homogeneous_value=1.0)
    assert adv[:4].tolist() == [1.0] * 4 and adv[4:8].tolist() == [-1.0] * 4
    # the mixed group keeps its z-score
    assert adv[8:].tolist() == pytest.approx(group_advantages(rewards[8:], 4, "group")[0].tolist())
    with pytest.raises(ValueError, match="correct"):
        group_advantages(rewards, 4, homogeneous_value=1.0)


def test_group_skewness_hand_value_and_clamp():
    # [1, 0, 0, 0]: mean 0.25, Bessel std 0.5, z = [1.5, -0.5, -0.5, -0.5], mean z^3 = (3.375 - 0.375) / 4 = 0.75,
    # adjusted by sqrt(4 * 3) / 2 -> 1.299; a flat group has skewness 0
    skew = group_skewness(torch.tensor([[1.0, 0.0, 0.0, 0.0], [2.0, 2.0, 2.0, 2.0], [0.0, 1.0, 1.0, 1.0]]))
    assert skew.tolist() == pytest.approx([0.75 * math.sqrt(12) / 2, 0.0, -0.75 * math.sqrt(12) / 2], rel=1e-5)
    assert group_skewness(torch.tensor([[0.0] * 15 + [1.0]]), max_abs=2.0).item() == 2.0


def test_per_completion_clip_range():
    logp = torch.log(torch.tensor([[1.5, 0.7], [1.5, 0.7]]))
    old = torch.zeros(2, 2)
    adv = torch.tensor([1.0, -1.0])
    mask = torch.ones(2, 2)
    eps = torch.tensor([0.1, 0.4])
    loss, stats = clipped_surrogate(logp, old, adv, mask, eps, eps)
    # row 0 (eps 0.1, A = 1): min(1.5, 1.1) = 1.1 and min(0.7, 0.7) = 0.7; row 1 (eps 0.4, A = -1):
    # -min(-1.5, -1.4) = 1.5 and -min(-0.7, -0.7) = 0.7
    assert loss.flatten().tolist() == pytest.approx([-1.1, -0.7, 1.5, 0.7])
    assert float(stats["clip_ratio/high_mean"]) == pytest.approx(0.25)  # row 0's 1.5 > 1.1


def test_dual_clip_caps_negative_advantage_losses():
    logp = torch.log(torch.tensor([[5.0, 1.2, 5.0]]))
    old = torch.zeros(1, 3)
    mask = torch.ones(1, 3)
    # A = -2: plain PPO loss is max(rho, clip(rho)) * 2 = 10, 2.4, 10; the dual clip caps at c |A| = 3 * 2 = 6
    loss, stats = clipped_surrogate(logp, old, torch.tensor([-2.0]), mask, 0.2, 0.2, dual_clip=3.0)
    assert loss.flatten().tolist() == pytest.approx([6.0, 2.4, 6.0])
    assert float(stats["clip_ratio/dual_mean"]) == pytest.approx(2 / 3)
    # positive advantages are untouched
    pos, _ = clipped_surrogate(logp, old, torch.tensor([2.0]), mask, 0.2, 0.2, dual_clip=3.0)
    assert pos.flatten().tolist() == pytest.approx([-2.4, -2.4, -2.4])
    # the capped tokens get no gradient
    leaf = logp.clone().requires_grad_(True)
    capped, _ = clipped_surrogate(leaf, old, torch.tensor([-2.0]), mask, 0.2, 0.2, dual_clip=3.0)
    capped.sum().backward()
    assert leaf.grad[0, 0] == 0 and leaf.grad[0, 2] == 0 and leaf.grad[0, 1] != 0


def test_entropy_bonus_gradient_chunked_equals_full_and_unit_temperature():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50, bias=False)
    hidden = torch.randn(12, 8, requires_grad=True)
    ids = torch.randint(0, 50, (12,))
    temps = torch.linspace(0.5, 1.5, 12)
    # reference: the full [12 x 50] distribution at once
    logp_all = torch.log_softmax(head(hidden) / temps[:, None], dim=1)
    want = -(logp_all.exp() * logp_all).sum(1)
    (grad_want,) = torch.autograd.grad(want.sum(), hidden)
    # chunks of 3 rows (150 elements): recomputed in backward, never the whole matrix
    _, got = token_logps_and_entropy(hidden, head, ids, temps, chunk_elements=150, entropy_grad=True)
    (grad_got,) = torch.autograd.grad(got.sum(), hidden)
    # equal to rounding, as above (3.4e-7 measured); an entropy gradient with p detached in -sum p log p (a term
    # missing) gives a relative difference of 1.0
    assert_close_to_scale(got, want, 1e-5, "entropies")
    assert_rel_close(grad_got, grad_want, 1e-5, "entropy gradient")
    # detached by default
    _, plain = token_logps_and_entropy(hidden, head, ids, temps)
    assert not plain.requires_grad
    # the model's own entropy (temperature 1), whatever temperature the tokens were sampled at
    _, unit = token_logps_and_entropy(hidden, head, ids, temps, entropy_at_unit_temperature=True)
    own = torch.log_softmax(head(hidden), dim=1)
    assert_close_to_scale(unit, -(own.exp() * own).sum(1), 1e-5, "entropies at temperature 1")


@pytest.mark.parametrize("loss_type", list(LOSS_TYPES))
def test_a_fully_masked_batch_gives_a_zero_loss_not_nan(loss_type):
    logp = torch.randn(2, 3, requires_grad=True)
    loss = aggregate_loss(logp * 2.0, torch.zeros(2, 3), loss_type, global_num_sequences=2, global_num_tokens=0,
                          max_completion_length=3)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(logp.grad, torch.zeros(2, 3))


def test_truncated_importance_weights_hand_values():
    train = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -4.0]])
    sampler = torch.tensor([[-1.0, -3.0, 0.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])  # the second row's third token is padding
    e = math.e
    token = truncated_importance_weights(train, sampler, mask, "token_truncate", clip_max=2.0)
    assert torch.allclose(token, torch.tensor([[1.0, 2.0, math.exp(-0.5)], [1.0, 1.0, 0.0]]))
    masked = truncated_importance_weights(train, sampler, mask, "token_mask", clip_max=2.0)
    assert torch.allclose(masked, torch.tensor([[1.0, 0.0, math.exp(-0.5)], [1.0, 1.0, 0.0]]))
    # a sequence's ratio is the product of its tokens' ratios: exp(0 + 1 - 0.5) = e^0.5; padding does not count
    seq = truncated_importance_weights(train, sampler, mask, "sequence_truncate", clip_max=10.0)
    assert torch.allclose(seq, torch.tensor([[e ** 0.5] * 3, [1.0, 1.0, 0.0]]))
    capped = truncated_importance_weights(train, sampler, mask, "sequence_truncate", clip_max=1.5)
    assert torch.allclose(capped, torch.tensor([[1.5] * 3, [1.0, 1.0, 0.0]]))
    dropped = truncated_importance_weights(train, sampler, mask, "sequence_mask", clip_max=1.5)
    assert torch.allclose(dropped, torch.tensor([[0.0] * 3, [1.0, 1.0, 0.0]]))
    # equal engines: every weight is 1; weights carry no gradient
    logp = torch.tensor([[-0.3, -0.7]], requires_grad=True)
    same = truncated_importance_weights(logp, logp.detach(), torch.ones(1, 2), "token_truncate")
    assert torch.equal(same, torch.ones(1, 2)) and not same.requires_grad
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode"):
        truncated_importance_weights(train, sampler, mask, "token_clip")


def test_weighted_rewards_skip_nan_and_give_0_where_every_function_skipped():
    nan = float("nan")
    rewards = torch.tensor([[1.0, 1.0], [0.0, nan], [nan, 0.5], [nan, nan]])  # (B=4 completions, K=2 functions)
    total = weighted_rewards(rewards, torch.tensor([1.0, 2.0]))
    assert total.tolist() == [3.0, 0.0, 1.0, 0.0]


def test_robust_probe_spread_has_no_std_fallback():
    # one correct answer among five: MAD and IQR are 0; advantages fall back to the std, the probe spread not
    one_right = torch.tensor([[1.0, 0.0, 0.0, 0.0, 0.0]])
    for kind in ("mad", "iqr"):
        assert dispersion(one_right, kind, dim=1).item() == pytest.approx(0.2**0.5)  # Bessel std: sqrt(0.8 / 4)
        assert dispersion(one_right, kind, dim=1, fallback_to_std=False).item() == 0.0
    spread = torch.tensor([[4.0, 0.0, 1.0, 2.0, 3.0]])  # MAD: 1.4826 * median |r - 2| = 1.4826
    assert dispersion(spread, "mad", dim=1, fallback_to_std=False).item() == pytest.approx(1.4826)


def _cispo_batch():
    """Ratios on both sides of the cap (1.2), positive and negative advantages, one padded position."""
    torch.manual_seed(0)
    old = -torch.rand(3, 4) - 0.5
    logp = (old + torch.tensor([[0.0, 0.4, -0.3, 0.25], [0.3, -0.1, 0.0, 0.5], [0.2, 0.1, -0.4, 0.0]])).requires_grad_()
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    return logp, old, torch.tensor([1.0, -0.5, 2.0]), mask


def test_cispo_loss_and_gradient_match_the_formula():
    """CISPO (MiniMax-M1, arXiv 2506.13585): l_it = -sg(min(rho_it, eps_max)) A_i log pi, averaged over the tokens of
    the global batch; every token keeps its gradient -w A grad log pi, also where the weight is capped."""
    logp, old, adv, mask = _cispo_batch()
    cap = 1.2
    per_token, stats = policy_loss("cispo", logp, old, adv, mask, 0.2, cap)
    loss = aggregate_loss(per_token, mask, "cispo", global_num_sequences=3, global_num_tokens=mask.sum(),
                          max_completion_length=4)
    loss.backward()
    ours = logp.grad.clone()

    leaf = logp.detach().clone().requires_grad_()
    weight = torch.exp(leaf - old).clamp(max=cap).detach()
    direct = (-(weight * adv[:, None] * leaf) * mask).sum() / mask.sum()
    direct.backward()
    assert torch.allclose(loss, direct) and torch.allclose(ours, leaf.grad)
    ratio = torch.exp(logp.detach() - old)
    assert bool(((ratio > cap) & (mask > 0)).any()) and bool((ours[(ratio > cap) & (mask > 0)] != 0).all())
    # the capped share on positive advantages, TRL's cispo_clip_ratio
    capped = ((ratio > cap) & (adv[:, None] > 0)).float()
    assert torch.allclose(stats["clip_ratio/high_mean"], (capped * mask).sum() / mask.sum())
    # on-policy every weight is 1: the gradient is -A grad log pi / tokens, as the clipped surrogate's
    fresh = logp.detach().clone().requires_grad_()
    on_policy, _ = policy_loss("cispo", fresh, fresh.detach(), adv, mask, 0.2, cap)
    aggregate_loss(on_policy, mask, "cispo", global_num_sequences=3, global_num_tokens=mask.sum(),
                   max_completion_length=4).backward()
    assert torch.allclose(fresh.grad, -adv[:, None] * mask / mask.sum())


def test_cispo_matches_trls_grpo_trainer_loss():
    """TRL's GRPOTrainer._compute_loss with loss_type "cispo" (its model pass replaced by our log-probs): the same
    value and the same gradient as policy_loss + aggregate_loss."""
    from collections import defaultdict
    from types import SimpleNamespace

    trainer_module = pytest.importorskip("trl.trainer.grpo_trainer")
    logp, old, adv, mask = _cispo_batch()
    cap = 1.2
    per_token, _ = policy_loss("cispo", logp, old, adv, mask, 0.2, cap)
    ours = aggregate_loss(per_token, mask, "cispo", global_num_sequences=3, global_num_tokens=mask.sum(),
                          max_completion_length=4)
    ours.backward()

    leaf = logp.detach().clone().requires_grad_()
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (leaf, torch.zeros_like(leaf), None),
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level="token", beta=0.0, loss_type="cispo", epsilon_low=0.2, epsilon_high=cap,
        use_vllm=False, _entropy_bonus_enabled=False, current_gradient_accumulation_steps=1,
        args=SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1),
        model=SimpleNamespace(training=True), _metrics=defaultdict(lambda: defaultdict(list)),
        accelerator=SimpleNamespace(num_processes=1, gather=lambda x: x, reduce=lambda x, reduction: x))
    inputs = {"prompt_ids": torch.zeros(3, 2, dtype=torch.long), "prompt_mask": torch.ones(3, 2, dtype=torch.long),
              "completion_ids": torch.zeros(3, 4, dtype=torch.long), "completion_mask": mask, "advantages": adv,
              "old_per_token_logps": old, "num_items_in_batch": mask.sum()}
    theirs = trainer_module.GRPOTrainer._compute_loss(trainer, None, inputs)
    theirs.backward()
    assert torch.allclose(ours, theirs) and torch.allclose(logp.grad, leaf.grad)
    assert trainer._metrics["train"]["cispo_clip_ratio"]  # TRL took its cispo branch


# ---------------------------------------------------------------------------------------------------------------------
# TRL 1.16's own loss (GRPOTrainer._compute_loss, its model pass replaced by given log-probs and entropies) against
# ours as train_agrpo.update_policy makes it: policy_objective (the surrogate, the off-policy and entropy masks, the
# vLLM importance weights), then aggregate_loss. Same tensors, both signs of the advantage, padding, and two accumulated
# micro-batches. docs/methods.md 1.7-1.11.

def _mixed_batch():
    """4 completions of up to 6 tokens, advantages of both signs, two rows padded; ratios from 0.6 to 2.7 so that
    every clip, gate, cap and mask below acts on some tokens of each sign and not on others."""
    torch.manual_seed(1)
    old = -torch.rand(4, 6) * 2.0 - 0.2
    shift = torch.tensor([[0.0, 0.4, -0.5, 0.25, 1.0, 0.1], [0.3, -0.1, 0.9, 0.5, -0.4, 0.0],
                          [0.2, 0.1, -0.4, 0.0, 0.6, -0.2], [-1.0, -0.35, -0.3, 0.15, 0.0, 0.0]])
    logp = old + shift
    mask = torch.tensor([[1.0] * 6, [1.0] * 4 + [0.0] * 2, [1.0] * 6, [1.0] * 5 + [0.0]])
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5])
    entropy = torch.rand(4, 6) * 3.0
    sampling = old + torch.tensor([[0.3, -0.2, 0.5, 0.0, 0.1, -1.2], [0.9, 0.8, 0.7, 0.6, 0.0, 0.0],
                                   [0.6, 0.4, 0.0, 0.2, 0.3, 0.1], [0.05, -0.05, 0.1, 0.0, -0.1, 0.0]])
    return logp, old, adv, mask, entropy, sampling


def _trl_compute_loss(logp, old, adv, mask, entropy, *, trainer=None, args=None, sampling=None, is_ratio=None,
                      accumulation=1, num_items=None):
    """TRL's GRPOTrainer._compute_loss on these tensors (one process; `num_items` the loss tokens of the whole
    generation batch, as TRL's num_items_in_batch)."""
    from collections import defaultdict
    from types import SimpleNamespace

    grpo = pytest.importorskip("trl.trainer.grpo_trainer").GRPOTrainer
    settings = dict(delta=None, use_bias_correction_kl=False, steps_per_generation=accumulation,
                    sapo_temperature_pos=1.0, sapo_temperature_neg=1.05)
    state = dict(aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
                 importance_sampling_level="token", beta=0.0, loss_type="grpo", epsilon_low=0.2, epsilon_high=0.2,
                 use_vllm=False, vllm_importance_sampling_correction=False, _entropy_bonus_enabled=False,
                 current_gradient_accumulation_steps=accumulation, max_completion_length=logp.shape[1])
    one_process = SimpleNamespace(num_processes=1, gather=lambda x: x, reduce=lambda x, reduction: x,
                                  pad_across_processes=lambda x, dim, pad_index: x)
    fake = SimpleNamespace(**{**state, **(trainer or {})}, args=SimpleNamespace(**{**settings, **(args or {})}),
                           model=SimpleNamespace(training=True), _metrics=defaultdict(lambda: defaultdict(list)),
                           accelerator=one_process, get_off_policy_mask=grpo.get_off_policy_mask,
                           _get_per_token_logps_and_entropies=lambda *a, **k: (logp, entropy, None))
    fake.get_high_entropy_mask = lambda *a: grpo.get_high_entropy_mask(fake, *a)
    b = logp.shape[0]
    inputs = {"prompt_ids": torch.zeros(b, 2, dtype=torch.long), "prompt_mask": torch.ones(b, 2, dtype=torch.long),
              "completion_ids": torch.zeros(logp.shape, dtype=torch.long), "completion_mask": mask,
              "advantages": adv, "old_per_token_logps": old,
              "num_items_in_batch": torch.as_tensor(mask.sum() if num_items is None else num_items)}
    if sampling is not None:
        inputs["sampling_per_token_logps"] = sampling
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    return grpo._compute_loss(fake, None, inputs), fake


def _ours(loss_type, logp, old, adv, mask, entropy, *, options=None, eps=(0.2, 0.2), level="token", sampling=None,
          off_policy=None, quantile=1.0, tis=None, accumulation=1, num_sequences=None, num_tokens=None):
    """Our loss for one micro-batch, as train_agrpo.update_policy makes it: policy_objective, then aggregate_loss."""
    mode, clip_max, clip_min = tis or ("token_truncate", 3.0, None)
    settings = ObjectiveSettings(loss_type, level, options or {}, off_policy, quantile, tis is not None, mode,
                                 clip_max, clip_min)
    per_token, _ = policy_objective(settings, logp, old, adv, mask, entropy, epsilon_low=eps[0], epsilon_high=eps[1],
                                    sampling_logp=sampling)
    return aggregate_loss(per_token, mask, loss_type, global_num_sequences=num_sequences or logp.shape[0],
                          global_num_tokens=mask.sum() if num_tokens is None else num_tokens,
                          max_completion_length=logp.shape[1], gradient_accumulation_steps=accumulation)


def _compare_with_trl(loss_type, ours_kwargs, trl_trainer, trl_args=None, *, accumulation=1, trl_extra=None):
    """Loss and gradient over the mixed batch, in `accumulation` micro-batches, ours against TRL's. Returns the
    largest absolute differences (loss, gradient) and the two gradients."""
    logp, old, adv, mask, entropy, sampling = _mixed_batch()
    ours_leaf, trl_leaf = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    ours_total = theirs_total = 0.0
    for rows in torch.arange(logp.shape[0]).chunk(accumulation):
        part = [t[rows] for t in (old, adv, mask, entropy, sampling)]
        ours = _ours(loss_type, ours_leaf[rows], part[0], part[1], part[2], part[3], accumulation=accumulation,
                     num_sequences=logp.shape[0], num_tokens=mask.sum(), **{"sampling": part[4], **ours_kwargs})
        extra = {key: value(part) for key, value in (trl_extra or {}).items()}
        theirs, fake = _trl_compute_loss(trl_leaf[rows], part[0], part[1], part[2], part[3],
                                         trainer={"loss_type": loss_type, **trl_trainer}, args=trl_args,
                                         accumulation=accumulation, num_items=mask.sum(), **extra)
        ours.backward()
        theirs.backward()
        ours_total, theirs_total = ours_total + ours.detach(), theirs_total + theirs.detach()
    return (float((ours_total - theirs_total).abs()), float((ours_leaf.grad - trl_leaf.grad).abs().max()),
            ours_leaf.grad, trl_leaf.grad)


def _assert_same_as_trl(*args, **kwargs):
    loss_gap, grad_gap, ours, _ = _compare_with_trl(*args, **kwargs)
    assert loss_gap < 1e-6 and grad_gap < 1e-6, (loss_gap, grad_gap)
    return ours


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("level, temperatures", [("token", (1.0, 1.05)), ("token", (0.5, 3.0)),
                                                 ("sequence", (1.0, 1.05))])
def test_sapo_matches_trls_loss_and_gradient(level, temperatures, accumulation):
    """SAPO (arXiv 2511.20347, docs/methods.md 1.8): -(4 / tau) sigmoid(tau (rho - 1)) A, tau by the sign of A, the
    per-sequence mean; the same value and gradient as TRL's loss_type "sapo"."""
    options = {"sapo_temperature_pos": temperatures[0], "sapo_temperature_neg": temperatures[1]}
    grad = _assert_same_as_trl("sapo", {"options": options, "level": level}, {"importance_sampling_level": level},
                               options, accumulation=accumulation)
    assert bool((grad != 0).any())


def test_sapo_gate_by_hand_and_on_policy_gradient_is_grpos():
    logp = torch.log(torch.tensor([[1.0, 1.5, 0.5]])).requires_grad_()
    mask, old = torch.ones(1, 3), torch.zeros(1, 3)
    loss, stats = policy_loss("sapo", logp, old, torch.tensor([-2.0]), mask, 0.2, 0.2, sapo_temperature_pos=1.0,
                              sapo_temperature_neg=2.0)
    # tau = 2 for A < 0: l = -(4 / 2) sigmoid(2 (rho - 1)) (-2) = 4 sigmoid(2 (rho - 1))
    sig = torch.sigmoid(torch.tensor([0.0, 1.0, -1.0]))
    assert loss[0].tolist() == pytest.approx((4 * sig).tolist(), rel=1e-6)
    loss.sum().backward()
    # d l / d log pi = 4 * 2 s (1 - s) * rho: the gate's weight 4 s (1 - s) times -A rho
    rho = torch.tensor([1.0, 1.5, 0.5])
    assert logp.grad[0].tolist() == pytest.approx((8 * sig * (1 - sig) * rho).tolist(), rel=1e-6)
    assert float(stats["clip_ratio/region_mean"]) == 0.0  # every weight above 1/2 here
    # on-policy the weight is exactly 1: GRPO's gradient -A grad log pi
    fresh = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    on, _ = policy_loss("sapo", fresh, fresh.detach(), torch.tensor([0.7]), torch.ones(1, 2), 0.2, 0.2,
                        sapo_temperature_pos=1.0, sapo_temperature_neg=1.05)
    on.sum().backward()
    assert fresh.grad.tolist()[0] == pytest.approx([-0.7, -0.7])
    with pytest.raises(ValueError, match="loss_type sapo takes no dual_clip"):
        policy_loss("sapo", fresh, fresh.detach(), torch.tensor([0.7]), torch.ones(1, 2), 0.2, 0.2, dual_clip=3.0)


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("loss_type, level", [("grpo", "token"), ("dapo", "token"), ("grpo", "sequence")])
def test_delta_is_dual_clip_for_every_sign_above_one_plus_epsilon_high(loss_type, level, accumulation):
    """TRL's delta (INTELLECT-2's two-sided clipping) read as our dual_clip (docs/methods.md 1.9): at
    delta >= 1 + epsilon_high, the same loss and gradient for positive, negative and zero advantages."""
    for delta in (1.2, 1.5, 2.2):  # 1 + epsilon_high itself, and ratios on both sides of the others
        _assert_same_as_trl(loss_type, {"options": {"dual_clip": delta}, "level": level},
                            {"importance_sampling_level": level}, {"delta": delta}, accumulation=accumulation)


def test_delta_below_one_plus_epsilon_high_differs_from_dual_clip_and_is_refused():
    """Below 1 + epsilon_high the two are different losses (docs/methods.md 1.9): for A < 0 dual-clip PPO caps the
    loss at c |A| inside the clip range, TRL's delta leaves it rho |A| there (its cap falls back to 1 + eps_high); for
    A > 0 TRL's delta caps rho at delta, dual-clip PPO leaves it alone. So lib/methods/losses.check_settings refuses that
    range."""
    from lib.config import ConfigError, make_config
    from lib.trl_keys import resolve_keys

    rho = torch.tensor([[1.15, 1.3]])
    logp, old, mask = torch.log(rho), torch.zeros(1, 2), torch.ones(1, 2)
    negative, _ = clipped_surrogate(logp, old, torch.tensor([-1.0]), mask, 0.2, 0.2, dual_clip=1.1)
    assert negative[0].tolist() == pytest.approx([1.1, 1.1])  # ours: capped at c |A| = 1.1
    loss_gap, grad_gap, *_ = _compare_with_trl("grpo", {"options": {"dual_clip": 1.1}}, {}, {"delta": 1.1})
    assert loss_gap > 1e-3 and grad_gap > 1e-3
    with pytest.raises(ConfigError, match=r"dual_clip \(TRL's delta\) 1.1 is below 1 \+ epsilon_high = 1.2"):
        make_config({"delta": 1.1}, keys=resolve_keys)
    assert make_config({"delta": 4.0}, keys=resolve_keys).dual_clip == 4.0


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("with_sampler", [True, False])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "sapo"])
def test_off_policy_mask_matches_trls(loss_type, with_sampler, accumulation):
    """DeepSeek-V3.2's off-policy sequence mask (docs/methods.md 1.10): the KL is taken to the sampler's log-probs
    where the rollout has them (vLLM), else to pi_old's, as TRL's loss takes them."""
    logp, old, adv, mask, _, sampling = _mixed_batch()
    reference = sampling if with_sampler else old
    keep = off_policy_sequence_mask(logp, reference, adv, mask, 0.1)
    gap = ((reference - logp) * mask).sum(1) / mask.sum(1)
    # it acts: a negative-advantage completion dropped, and a positive one kept although its KL is as high
    assert keep[:, 0].tolist() == [float(not (a < 0 and g > 0.1)) for a, g in zip(adv.tolist(), gap.tolist())]
    assert 0.0 in keep[:, 0].tolist()
    assert not with_sampler or any(a > 0 and g > 0.1 for a, g in zip(adv.tolist(), gap.tolist()))
    extra = {"sampling": lambda part: part[4]} if with_sampler else {}
    ours = {"off_policy": 0.1} if with_sampler else {"off_policy": 0.1, "sampling": None}  # None: pi_old's
    _assert_same_as_trl(loss_type, ours, {"off_policy_mask_threshold": 0.1}, trl_extra=extra,
                        accumulation=accumulation)


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("quantile", [0.0, 0.2, 0.5])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo", "sapo"])
def test_top_entropy_mask_matches_trls(loss_type, quantile, accumulation):
    """The 80/20 rule (arXiv 2506.01939, docs/methods.md 1.11): the threshold is the (1 - quantile) quantile of one
    micro-batch's loss tokens (padding left out), as TRL's get_high_entropy_mask."""
    _assert_same_as_trl(loss_type, {"quantile": quantile}, {"top_entropy_quantile": quantile},
                        accumulation=accumulation)


def test_top_entropy_threshold_by_hand_padding_and_its_micro_batch_dependence():
    entropy = torch.tensor([[0.1, 0.9, 0.5, 7.0], [0.3, 0.7, 0.2, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    # pool (7 loss tokens): 0.0 0.1 0.2 0.3 0.5 0.7 0.9; its 0.8 quantile sits at position 0.8 x 6 = 4.8: 0.66
    kept = high_entropy_mask(entropy, mask, 0.2)
    assert kept.tolist() == [[0.0, 1.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]]  # padding (7.0) never counts nor is kept
    assert high_entropy_mask(entropy, mask, 0.0).tolist() == [[0.0, 1.0, 0.0, 0.0], [0.0] * 4]
    assert high_entropy_mask(entropy, mask, 1.0).tolist() == mask.tolist()
    assert not high_entropy_mask(entropy, torch.zeros(2, 4), 0.2).any()
    # the threshold is each micro-batch's, as TRL's: at 0.4 the whole batch's is 0.42 (position 3.6), the second row's
    # alone 0.28 (position 1.8 of its 4 tokens), so split into two micro-batches it keeps one token more
    assert high_entropy_mask(entropy, mask, 0.4)[1].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert high_entropy_mask(entropy[1:], mask[1:], 0.4).tolist() == [[1.0, 1.0, 0.0, 0.0]]


def _trls_importance_sampling_ratio(old, sampling, mask, mode, clip_max, clip_min):
    """TRL's own lines that turn (pi_old, pi_vllm) log-probs into the importance weights (inside its
    _generate_and_score_completions), run on these tensors."""
    import inspect
    import math as math_module
    import textwrap
    from types import SimpleNamespace

    grpo = pytest.importorskip("trl.trainer.grpo_trainer").GRPOTrainer
    lines = inspect.getsource(grpo._generate_and_score_completions).splitlines()
    first = next(i for i, line in enumerate(lines) if "per_token_logps_diff = (old_per_token_logps - sampling" in line)
    last = next(i for i in range(first, len(lines)) if "per-token log probabilities for the reference" in lines[i])
    code = textwrap.dedent("\n".join(lines[first - 1:last]))
    assert "vllm_importance_sampling_clip_min" in code  # TRL's block was found
    scope = {"torch": torch, "math": math_module, "completion_mask": mask, "tool_mask": None,
             "old_per_token_logps": old, "sampling_per_token_logps": sampling,
             "self": SimpleNamespace(vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_max=clip_max,
                                     vllm_importance_sampling_clip_min=clip_min)}
    exec(code, scope)
    return scope["vllm_importance_sampling_ratio"]


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("clip_max, clip_min", [(3.0, None), (1.5, 0.5), (None, 0.7), (1.3, 0.9)])
@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_vllm_importance_sampling_matches_trls(mode, clip_max, clip_min, accumulation):
    """Every vllm_importance_sampling_mode of TRL 1.16 with both bounds (token_mask with both is IcePop;
    docs/methods.md 1.12): TRL's weights from its own lines, then its loss; ours from truncated_importance_weights."""
    logp, old, adv, mask, _, sampling = _mixed_batch()
    theirs = _trls_importance_sampling_ratio(old, sampling, mask, mode, clip_max, clip_min).expand_as(logp) * mask
    ours = truncated_importance_weights(old, sampling, mask, mode, clip_max, clip_min)
    assert torch.allclose(ours, theirs, atol=1e-6)
    extra = {"is_ratio": lambda part: _trls_importance_sampling_ratio(part[0], part[4], part[2], mode, clip_max,
                                                                      clip_min)}
    _assert_same_as_trl("grpo", {"tis": (mode, clip_max, clip_min)},
                        {"use_vllm": True, "vllm_importance_sampling_correction": True}, trl_extra=extra,
                        accumulation=accumulation)


def test_importance_weights_two_sided_by_hand():
    train = torch.tensor([[-1.0, -2.0, -0.5, -1.0]])
    sampler = torch.tensor([[-1.0, -3.0, 0.0, float("nan")]])  # ratios 1, e, e^-0.5, and an unscored token
    mask = torch.ones(1, 4)
    e = math.e
    assert torch.allclose(truncated_importance_weights(train, sampler, mask, "token_truncate", 2.0, 0.7),
                          torch.tensor([[1.0, 2.0, 0.7, 1.0]]))
    assert torch.allclose(truncated_importance_weights(train, sampler, mask, "token_mask", 3.0, 0.7),
                          torch.tensor([[1.0, e, 0.0, 1.0]]))  # IcePop: outside [0.7, 3] leaves the gradient
    assert torch.allclose(truncated_importance_weights(train, sampler, mask, "token_mask", None, 0.7),
                          torch.tensor([[1.0, e, 0.0, 1.0]]))
    # the sequence ratio e^0.5 is inside [0.5, 2]; below a floor of 2 it is raised to it, or masked
    assert torch.allclose(truncated_importance_weights(train, sampler, mask, "sequence_truncate", 3.0, 2.0),
                          torch.full((1, 4), 2.0))
    assert not truncated_importance_weights(train, sampler, mask, "sequence_mask", 3.0, 2.0).any()


# ---- multi_objective_aggregation normalize_then_sum (GDPO, docs/methods.md 13.1) -------------------------------------

def _gdpo_by_hand(rewards: list[list[float]], weights: list[float], group_size: int) -> list[float]:
    """GDPO's three lines with Python's statistics module: each function normalised in its group (NaN skipped; a
    group with one value adds nothing), the weighted sum, then normalised over the batch's scorable completions."""
    import statistics

    n, k = len(rewards), len(weights)
    sums = [0.0] * n
    for start in range(0, n, group_size):
        rows = range(start, start + group_size)
        for j in range(k):
            values = [rewards[i][j] for i in rows if not math.isnan(rewards[i][j])]
            if len(values) < 2:
                continue
            mean, std = statistics.fmean(values), statistics.stdev(values)
            for i in rows:
                if not math.isnan(rewards[i][j]):
                    sums[i] += weights[j] * (rewards[i][j] - mean) / (std + 1e-4)
    scorable = [i for i in range(n) if not all(math.isnan(v) for v in rewards[i])]
    kept = [sums[i] for i in scorable]
    mean, std = statistics.fmean(kept), statistics.stdev(kept)
    return [(sums[i] - mean) / (std + 1e-4) if i in scorable else 0.0 for i in range(n)]


def test_normalize_then_sum_matches_hand_values_with_nan_and_weights():
    """Two groups of 3, two functions weighted 1 and 0.5, with a function that skips a completion (NaN) and a
    completion every function skipped (advantage 0, out of the batch statistics). TRL 1.16 has no function for
    this to call (the lines sit inside GRPOTrainer._generate_and_score_completions); the formula is its."""
    nan = float("nan")
    rewards = [[1.0, 0.2], [0.0, 0.4], [0.0, 0.6], [1.0, nan], [1.0, 0.9], [nan, nan]]
    weights = [1.0, 0.5]
    ours = normalize_then_sum(torch.tensor(rewards), torch.tensor(weights), 3)
    assert ours.tolist() == pytest.approx(_gdpo_by_hand(rewards, weights, 3), rel=1e-6, abs=1e-6)
    assert ours[5] == 0.0
    # through group_advantages: the same, whatever scale_rewards says, and the stats stay those of the total
    total = weighted_rewards(torch.tensor(rewards), torch.tensor(weights))
    for scale in ("group", "batch"):
        adv, stats = group_advantages(total, 3, scale, aggregation="normalize_then_sum",
                                      per_function=torch.tensor(rewards), weights=torch.tensor(weights))
        assert torch.equal(adv, ours)
        assert torch.equal(stats["reward_std"], group_advantages(total, 3, scale)[1]["reward_std"])


def test_normalize_then_sum_keeps_a_small_reward_apart_from_a_wide_one():
    """GDPO's point (arXiv 2601.05242, section 3): summed first, a reward with a wide range drowns a small one; the
    completion with the better format gets no more advantage than its group's other wrong answer. Normalised per
    function first, it does."""
    rewards = torch.tensor([[10.0, 0.0], [0.0, 1.0], [0.0, 0.0], [10.0, 1.0]])  # (accuracy x10, format)
    weights = torch.ones(2)
    summed, _ = group_advantages(weighted_rewards(rewards, weights), 4, "group")
    decoupled = normalize_then_sum(rewards, weights, 4)
    assert float(decoupled[1] - decoupled[2]) > 5 * float(summed[1] - summed[2]) > 0
    # and for one function it is group normalisation followed by a batch normalisation
    one = rewards[:, :1]
    by_group, _ = group_advantages(one[:, 0], 2, "group")
    again = (by_group - by_group.mean()) / (by_group.std() + 1e-4)
    assert torch.allclose(normalize_then_sum(one, torch.ones(1), 2), again, atol=1e-6)


def test_normalize_then_sum_composes_with_agpo_homogeneous_values():
    """AGPO's fixed values for all-right / all-wrong groups (judged on correctness) replace GDPO's advantages there,
    as they replace the group-normalised ones."""
    rewards = torch.tensor([[1.0, 0.1], [1.0, 0.3], [0.0, 0.2], [1.0, 0.4]])
    correct = rewards[:, 0] > 0
    adv, _ = group_advantages(weighted_rewards(rewards, torch.ones(2)), 2, "group", correct=correct,
                              homogeneous_value=0.1, aggregation="normalize_then_sum", per_function=rewards,
                              weights=torch.ones(2))
    assert adv[:2].tolist() == pytest.approx([0.1, 0.1])
    assert torch.equal(adv[2:], normalize_then_sum(rewards, torch.ones(2), 2)[2:])
    with pytest.raises(ValueError, match="per_function"):
        group_advantages(rewards[:, 0], 2, aggregation="normalize_then_sum")


# ---- policy_objective: every per-token term and its statistics (docs/methods.md 6.1, phase 5) ------------------------

def _objective(loss_type="grpo", **settings):
    return ObjectiveSettings(loss_type, **settings)


def test_objective_masks_by_hand_with_their_shares_and_the_gathered_pool():
    """On-policy (rho = 1) grpo's term is -A on every token; the off-policy mask drops the negative-advantage row whose
    mean log-prob gap to the sampler is above the threshold, the 80/20 mask the tokens below the entropy quantile
    (padding in neither count nor pool), and each share is summed over the loss tokens."""
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -0.7]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([1.0, -1.0])
    # sampler minus policy: row 0 gaps 2 (kept anyway, A > 0); row 1 (1 + 0.5) / 2 = 0.75 over its two tokens > 0.5
    sampling = logp + torch.tensor([[2.0, 2.0, 2.0], [1.0, 0.5, -9.0]])
    entropy = torch.tensor([[0.1, 0.9, 0.5], [0.3, 0.7, 5.0]])
    args = dict(epsilon_low=0.2, epsilon_high=0.2, sampling_logp=sampling)

    plain, stats = policy_objective(_objective(), logp, logp, adv, mask, entropy, **args)
    assert plain.tolist() == [[-1.0] * 3, [1.0] * 3]
    assert set(stats.sums) == {"clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "kl"}
    assert not any(stats.sums.values()) and not stats.maxima and not stats.minima  # no clip on-policy, beta 0

    masked, stats = policy_objective(_objective(off_policy_mask_threshold=0.5), logp, logp, adv, mask, entropy, **args)
    assert masked.tolist() == [[-1.0] * 3, [0.0] * 3]
    assert float(stats.sums["masked/off_policy"]) == pytest.approx(2.0)  # row 1's two loss tokens

    # the pool of the 5 loss tokens 0.1 0.3 0.5 0.7 0.9: its median 0.5; kept: 0.9 and 0.5, 0.7 (not 5.0, padding)
    high = _objective(top_entropy_quantile=0.5)
    kept, stats = policy_objective(high, logp, logp, adv, mask, entropy, **args)
    assert kept.tolist() == [[0.0, -1.0, -1.0], [0.0, 1.0, 0.0]]
    assert float(stats.sums["masked/low_entropy"]) == pytest.approx(2.0)  # 0.1 and 0.3
    # a pool gathered from every process: 8 tokens, median (0.7 + 0.8) / 2 = 0.75, so only 0.9 stays
    pool = torch.tensor([0.1, 0.9, 0.5, 0.3, 0.7, 0.8, 0.85, 0.95])
    kept, stats = policy_objective(high, logp, logp, adv, mask, entropy, entropy_pool=pool, **args)
    assert kept.tolist() == [[0.0, -1.0, 0.0], [0.0, 0.0, 0.0]]
    assert float(stats.sums["masked/low_entropy"]) == pytest.approx(4.0)

    both, stats = policy_objective(_objective(off_policy_mask_threshold=0.5, top_entropy_quantile=0.5), logp, logp,
                                   adv, mask, entropy, **args)
    assert both.tolist() == [[0.0, -1.0, -1.0], [0.0, 0.0, 0.0]]
    assert {k: float(stats.sums[k]) for k in ("masked/off_policy", "masked/low_entropy")} == {
        "masked/off_policy": pytest.approx(2.0), "masked/low_entropy": pytest.approx(2.0)}


def test_objective_importance_weights_and_their_statistics_by_hand():
    """w = clamp(pi_old / pi_sampling, 0.5, 2) on the policy term; the sums of w and of |log pi_old - log pi_sampling|
    over the loss tokens, their largest, and the smallest w (padding out of all of them)."""
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -1.0]])
    sampling = torch.tensor([[-1.0, -3.0, 0.5], [-1.5, -0.75, -4.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([1.0, -1.0])
    settings = _objective(importance_sampling=True, importance_sampling_mode="token_truncate",
                          importance_sampling_clip_max=2.0, importance_sampling_clip_min=0.5)
    per_token, stats = policy_objective(settings, old, old, adv, mask, torch.zeros(2, 3), epsilon_low=0.2,
                                        epsilon_high=0.2, sampling_logp=sampling)
    # ratios 1, e (capped at 2), e^-1 (raised to 0.5); e^0.5, e^-0.25, padding 0
    w = [[1.0, 2.0, 0.5], [math.exp(0.5), math.exp(-0.25), 0.0]]
    assert torch.allclose(per_token, torch.tensor([[-1.0, -2.0, -0.5], [w[1][0], w[1][1], 0.0]]))
    got = {k: float(v) for part in (stats.sums, stats.maxima, stats.minima) for k, v in part.items()}
    assert got == pytest.approx({
        "clip_ratio/low_mean": 0.0, "clip_ratio/high_mean": 0.0, "clip_ratio/region_mean": 0.0, "kl": 0.0,
        "sampling/importance_sampling_ratio/mean": 3.5 + w[1][0] + w[1][1],
        "sampling/sampling_logp_difference/mean": 0.0 + 1.0 + 1.0 + 0.5 + 0.25,
        "sampling/importance_sampling_ratio/max": 2.0, "sampling/sampling_logp_difference/max": 1.0,
        "sampling/importance_sampling_ratio/min": 0.5})
    # off (the HF sampler), or no sampler log-probs in this rollout: no weight, no statistics of it
    for off, given in ((_objective(), sampling), (settings, None)):
        plain, stats = policy_objective(off, old, old, adv, mask, torch.zeros(2, 3), epsilon_low=0.2,
                                        epsilon_high=0.2, sampling_logp=given)
        assert plain.tolist() == [[-1.0] * 3, [1.0] * 3] and not stats.maxima and not stats.minima


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_objective_kl_with_and_without_bias_correction_by_hand(level):
    """beta k3 with u = pi_ref / pi: pi = (0.5, 0.25), pi_ref = (0.25, 0.5), so u = (1/2, 2) and k3 = u - log u - 1 =
    (ln 2 - 1/2, 1 - ln 2), which sum to 1/2. With the bias correction the term is weighted by rho = pi / pi_old
    (pi_old = (0.4, 0.25): rho = (1.25, 1), or GSPO's sqrt(1.25) on both), and its gradient is
    beta rho (k3 + 1 - u) instead of beta (1 - u). A = 0 leaves the surrogate out; the logged KL sum is k3's."""
    beta = 0.1
    pi, old, ref = torch.tensor([[0.5, 0.25]]), torch.tensor([[0.4, 0.25]]), torch.tensor([[0.25, 0.5]])
    k3, u = [math.log(2) - 0.5, 1 - math.log(2)], [0.5, 2.0]
    rho = [1.25, 1.0] if level == "token" else [math.sqrt(1.25)] * 2
    for corrected, weight in ((False, [1.0, 1.0]), (True, rho)):
        logp = pi.log().requires_grad_()
        settings = _objective(importance_sampling_level=level, kl_estimator="k3", bias_correction_kl=corrected)
        per_token, stats = policy_objective(settings, logp, old.log(), torch.zeros(1), torch.ones(1, 2),
                                            torch.zeros(1, 2), epsilon_low=0.2, epsilon_high=0.2, beta=beta,
                                            ref_logp=ref.log())
        assert per_token[0].tolist() == pytest.approx([beta * k * w for k, w in zip(k3, weight)], rel=1e-6)
        assert float(stats.sums["kl"]) == pytest.approx(0.5, rel=1e-6)
        per_token.sum().backward()
        if not corrected:
            want = [beta * (1 - v) for v in u]
        elif level == "token":
            want = [beta * w * (k + 1 - v) for k, w, v in zip(k3, weight, u)]
        else:  # d sqrt(rho_1 rho_2) / d log pi_t = s / 2 on both tokens: beta s (k3_1 + k3_2) / 2 + beta s (1 - u_t)
            want = [beta * w * (sum(k3) / 2 + 1 - v) for w, v in zip(weight, u)]
        assert logp.grad[0].tolist() == pytest.approx(want, rel=1e-5)
    with pytest.raises(ValueError, match="beta > 0 needs ref_logp"):
        policy_objective(_objective(), pi.log(), pi.log(), torch.zeros(1), torch.ones(1, 2), torch.zeros(1, 2),
                         epsilon_low=0.2, epsilon_high=0.2, beta=beta)


def test_objective_entropy_bonus_by_hand():
    """-eta H on every token (the mask acts in aggregate_loss): each token's entropy gets the gradient -eta; with
    eta 0 the entropy is not in the loss at all."""
    entropy = torch.tensor([[0.5, 1.5, 2.0]], requires_grad=True)
    logp = torch.tensor([[-1.0, -2.0, -3.0]])
    per_token, _ = policy_objective(_objective(), logp, logp, torch.zeros(1), torch.tensor([[1.0, 1.0, 0.0]]),
                                    entropy, epsilon_low=0.2, epsilon_high=0.2, eta=0.01)
    assert per_token[0].tolist() == pytest.approx([-0.005, -0.015, -0.02])
    per_token.sum().backward()
    assert entropy.grad[0].tolist() == pytest.approx([-0.01] * 3)
    without, _ = policy_objective(_objective(), logp, logp, torch.zeros(1), torch.ones(1, 3), entropy,
                                  epsilon_low=0.2, epsilon_high=0.2)
    assert not without.requires_grad


def test_objective_statistics_of_two_micro_batches_add_up_to_the_whole_batchs():
    """Off the policy, with the clip, the off-policy mask and the importance weights on: the statistics of two halves
    combined (`+`: sums added, the largest and the smallest kept) are those of the whole batch, which the loop
    divides by the step's loss tokens; and every one acts here (none is 0)."""
    logp, old, adv, mask, entropy, sampling = _mixed_batch()
    settings = _objective(off_policy_mask_threshold=0.1, importance_sampling=True,
                          importance_sampling_mode="token_truncate", importance_sampling_clip_max=1.5)
    ref = old - 0.3
    run = lambda rows: policy_objective(settings, logp[rows], old[rows], adv[rows], mask[rows], entropy[rows],
                                        epsilon_low=0.2, epsilon_high=0.2, beta=0.05, ref_logp=ref[rows],
                                        sampling_logp=sampling[rows])[1]
    whole, halves = run(slice(0, 4)), ObjectiveStats() + run(slice(0, 2)) + run(slice(2, 4))
    for part in ("sums", "maxima", "minima"):
        mine, theirs = getattr(whole, part), getattr(halves, part)
        assert mine.keys() == theirs.keys() and all(float(mine[k]) > 0 for k in mine)
        assert all(float(mine[k]) == pytest.approx(float(theirs[k]), rel=1e-6) for k in mine), part
    first, second = ObjectiveStats({"a": torch.tensor(1.0)}, {"m": torch.tensor(2.0)}, {"n": torch.tensor(3.0)}), \
        ObjectiveStats({"a": torch.tensor(4.0), "b": torch.tensor(5.0)}, {"m": torch.tensor(1.0)},
                       {"n": torch.tensor(-1.0)})
    total = first + second
    assert ({k: float(v) for k, v in total.sums.items()}, float(total.maxima["m"]), float(total.minima["n"])) == (
        {"a": 5.0, "b": 5.0}, 2.0, -1.0)


def test_objective_settings_from_a_configuration_and_refused_values():
    from lib.config import make_config

    cfg = make_config({"loss_type": "sapo", "sapo_temperature_neg": 2.0, "top_entropy_quantile": 0.2,
                       "off_policy_mask_threshold": 0.5, "use_bias_correction_kl": True, "kl_estimator": "k1",
                       "importance_sampling_level": "sequence"})
    settings = ObjectiveSettings.of(cfg)
    assert settings == ObjectiveSettings("sapo", "sequence", {"sapo_temperature_pos": 1.0, "sapo_temperature_neg": 2.0},
                                         0.5, 0.2, False, cfg.vllm_importance_sampling_mode,
                                         cfg.vllm_importance_sampling_clip_max, cfg.vllm_importance_sampling_clip_min,
                                         "k1", True)
    assert not settings.importance_sampling  # the HF sampler samples with the trained weights: no weights
    with pytest.raises(ValueError, match="loss_type must be one of"):
        ObjectiveSettings("ppo")
    with pytest.raises(ValueError, match="loss_type sapo takes no dual_clip"):
        ObjectiveSettings("sapo", loss_options={"dual_clip": 3.0})
    with pytest.raises(ValueError, match="kl_estimator must be one of"):
        ObjectiveSettings("grpo", kl_estimator="k9")
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode must be one of"):
        ObjectiveSettings("grpo", importance_sampling_mode="token")
