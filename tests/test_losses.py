"""Hand-computed values for the GRPO math in lib/losses.py (ALGORITHMS.md section 1)."""

import math

import pytest
import torch

from lib.losses import (aggregate_loss, clipped_surrogate, group_advantages, kl_penalty, masked_mean,
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
    assert torch.allclose(logits.grad, full, atol=1e-6)
    # two processes of B/2 each: every process scales by num_processes, DDP averages the two gradients
    logits.grad = None
    loss_of(slice(0, 2), num_processes=2).backward()
    g0 = logits.grad.clone()
    logits.grad = None
    loss_of(slice(2, 4), num_processes=2).backward()
    assert torch.allclose((g0 + logits.grad) / 2, full, atol=1e-6)


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
    assert torch.allclose(logp, full.gather(1, ids[:, None]).squeeze(1), atol=1e-6)
    assert torch.allclose(entropy, -(full.exp() * full).sum(-1), atol=1e-5)
    logp.sum().backward()
    chunked_grad = hidden.grad.clone()
    hidden.grad = None
    full.gather(1, ids[:, None]).sum().backward()
    assert torch.allclose(chunked_grad, hidden.grad, atol=1e-6)
    one_chunk, _ = token_logps_and_entropy(hidden, head, ids, temps)  # all rows in one chunk, no recompute
    assert torch.allclose(one_chunk, logp, atol=1e-6)


def test_masked_mean():
    assert masked_mean(torch.tensor([1.0, 2.0, 9.0]), torch.tensor([1, 1, 0])).item() == 1.5
    assert masked_mean(torch.tensor([1.0]), torch.tensor([0])).item() == 0.0
