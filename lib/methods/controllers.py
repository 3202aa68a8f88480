"""Adaptive controllers as pure state transitions: `state = update(state, observed, cfg)`.

Each state is a small frozen dataclass holding floats only, so it goes into `trainer_state.json` as is and a resumed
run continues with exactly the state it had (`to_dict` / `from_dict`). The training loop calls each update once per
step, at a fixed place, and logs every field. Nothing here touches a model, a tensor or the loop's variables: `cfg`
is any object with the named attributes (the trainer passes its Config); `observed` are plain numbers the loop
measured. Imports nothing of ours.

    A-GRPO   KLControllerState, update_kl_controller: beta_t and epsilon_t from a moving average of the KL
             EntropyControllerState, update_entropy_controller: eta_t (Skywork-OR1's adaptive entropy control)
             GroupSizeState, update_group_size:        adaptive group size from the share of zero-spread groups
    adaGRPO  resample_plan, parse_resample_schedule:   the retry budget and the sampling parameters of each retry
    AGPO-DSF DSFState, dsf_temperatures, dsf_clip_ranges, update_step_kl, vote_entropy
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass


def to_dict(state) -> dict:
    return dataclasses.asdict(state)


def from_dict(cls, values: dict):
    """Rebuild a state from `to_dict` output (a checkpoint); unknown keys are an error, missing ones keep defaults."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(values) - names
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown fields {sorted(unknown)} in the saved controller state")
    return cls(**values)


def _clip(value: float, low: float, high: float) -> float:
    return min(max(value, low), high)


# ---------------------------------------------------------------------------------------------------------------------
# A-GRPO: beta_t and epsilon_t from the KL moving average (docs/methods.md 2.2, [RECON]). The proportional-error form is
# Ziegler et al. 2019's adaptive KL controller (TRL AdaptiveKLController), whose error is clipped to +-0.2.

KL_ERROR_CLIP = 0.2


@dataclass(frozen=True)
class KLControllerState:
    beta: float
    epsilon: float
    kl_ema: float | None = None  # None until the first KL is observed (K_0 = KL_0)


def init_kl_controller(cfg) -> KLControllerState:
    return KLControllerState(beta=float(cfg.beta), epsilon=float(cfg.epsilon))


def update_kl_controller(state: KLControllerState, kl: float, cfg) -> KLControllerState:
    """One step of the A-GRPO controller after a policy update that measured a token-mean KL of `kl`.

        K_t     = lambda K_{t-1} + (1 - lambda) KL_t          (K_0 = KL_0; lambda = cfg.kl_ema_decay)
        e_t     = clip(K_t / KL_target - 1, -0.2, 0.2)
        beta'   = clip(beta_t (1 + k_beta e_t), beta_min, beta_max)
        eps'    = clip(eps_0 (1 - k_eps e_t), epsilon_min, epsilon_max)   (eps_0 = cfg.epsilon)
    KL above target: beta grows and the trust region shrinks; below target: the reverse.
    """
    ema = kl if state.kl_ema is None else cfg.kl_ema_decay * state.kl_ema + (1.0 - cfg.kl_ema_decay) * kl
    error = _clip(ema / cfg.kl_target - 1.0, -KL_ERROR_CLIP, KL_ERROR_CLIP)
    beta = _clip(state.beta * (1.0 + cfg.kl_beta_rate * error), cfg.beta_min, cfg.beta_max)
    epsilon = _clip(cfg.epsilon * (1.0 - cfg.kl_epsilon_rate * error), cfg.epsilon_min, cfg.epsilon_max)
    return KLControllerState(beta=beta, epsilon=epsilon, kl_ema=ema)


# Adaptive entropy control (He et al. 2025, Skywork-OR1 technical report, arXiv 2505.22312, section 4 "adaptive
# entropy control"; TRL's use_adaptive_entropy; docs/methods.md 2.6), offered to A-GRPO in place of its fixed eta.


@dataclass(frozen=True)
class EntropyControllerState:
    eta: float  # the coefficient c_k (TRL's entropy_coef); it starts at cfg.eta
    entropy: float | None = None  # the last measured token-mean entropy e_k; None before the first step (TRL: +inf)


def init_entropy_controller(cfg) -> EntropyControllerState:
    return EntropyControllerState(eta=float(cfg.eta))


def entropy_bonus_weight(state: EntropyControllerState, cfg) -> float:
    """The weight of the entropy bonus in the next step's loss: c_k while e_k <= entropy_target, else 0 (and 0 before
    any entropy was measured). Skywork-OR1: the bonus acts only when the entropy has fallen to the target, so a policy
    that is exploring enough is left alone."""
    return state.eta if state.entropy is not None and state.entropy <= cfg.entropy_target else 0.0


def update_entropy_controller(state: EntropyControllerState, entropy: float, cfg) -> EntropyControllerState:
    """After an optimizer step whose trained tokens had a token-mean entropy of `entropy` (nats):

        c_{k+1} = min(c_k + delta, c_max)   if e_k <= e_target
                  max(c_k - delta, c_min)   otherwise          (delta = entropy_coef_delta, e_target = entropy_target)
    """
    if entropy <= cfg.entropy_target:
        eta = min(state.eta + cfg.entropy_coef_delta, cfg.entropy_coef_max)
    else:
        eta = max(state.eta - cfg.entropy_coef_delta, cfg.entropy_coef_min)
    return EntropyControllerState(eta=eta, entropy=entropy)


# A-GRPO adaptive group size (docs/methods.md 2.2, [RECON], off by default): many all-equal groups mean too few samples
# to see a difference, so double G; almost none mean G can halve. Thresholds and the 0.9 average are the spec's.
ZERO_STD_HIGH, ZERO_STD_LOW, ZERO_STD_EMA_DECAY = 0.5, 0.1, 0.9


@dataclass(frozen=True)
class GroupSizeState:
    num_generations: int
    zero_std_ema: float | None = None


def init_group_size(cfg) -> GroupSizeState:
    return GroupSizeState(num_generations=int(cfg.num_generations))


def update_group_size(state: GroupSizeState, frac_zero_std: float, cfg) -> GroupSizeState:
    """z_t = EMA_0.9(share of groups with all rewards equal); G doubles above 0.5, halves below 0.1, within
    [group_size_min, group_size_max]."""
    ema = frac_zero_std if state.zero_std_ema is None else \
        ZERO_STD_EMA_DECAY * state.zero_std_ema + (1.0 - ZERO_STD_EMA_DECAY) * frac_zero_std
    size = state.num_generations
    if ema > ZERO_STD_HIGH:
        size = min(2 * size, cfg.group_size_max)
    elif ema < ZERO_STD_LOW:
        size = max(size // 2, cfg.group_size_min)
    return GroupSizeState(num_generations=size, zero_std_ema=ema)


# ---------------------------------------------------------------------------------------------------------------------
# adaGRPO: resample a prompt's group with other sampling parameters while none of its completions is correct
# (docs/methods.md 4.1-4.2, [CODE]). The schedule is a list of triggers {step, params: [retry 1 params, retry 2 ...]};
# from its step on a trigger sets the budget (= len(params)) and the parameters of each retry.

RESAMPLE_KEYS = ("temperature", "top_p")

# the latest upstream schedule (whaaaaaatt/adaGRPO 213090a, LLMRLV6math.py), docs/methods.md 4.2
ADAGRPO_SCHEDULE = [
    {"step": 1, "params": [{"temperature": 1.0}] * 2},
    {"step": 100, "params": [{"temperature": 1.0}] * 2 + [{"temperature": 1.1, "top_p": 0.99}] * 2},
    {"step": 300, "params": [{"temperature": 1.0}] * 4 + [{"temperature": 1.1, "top_p": 0.99}] * 4},
    {"step": 700, "params": [{"temperature": 1.0}] * 5 + [{"temperature": 1.1, "top_p": 0.99}] * 6
     + [{"temperature": 1.3, "top_p": 0.97}] * 5},
]


def parse_resample_schedule(schedule: list[dict]) -> list[dict]:
    """Check a schedule and return it sorted by step. Raises ValueError naming the bad entry."""
    checked = []
    for i, trigger in enumerate(schedule):
        where = f"resample_schedule[{i}]"
        if not isinstance(trigger, dict) or set(trigger) != {"step", "params"}:
            raise ValueError(f"{where} must be a mapping with exactly the keys 'step' and 'params', got {trigger!r}")
        if not isinstance(trigger["step"], int) or trigger["step"] < 1:
            raise ValueError(f"{where}.step must be an integer >= 1, got {trigger['step']!r}")
        if not isinstance(trigger["params"], list):
            raise ValueError(f"{where}.params must be a list with one mapping per retry")
        for j, params in enumerate(trigger["params"]):
            if not isinstance(params, dict) or not set(params) <= set(RESAMPLE_KEYS):
                raise ValueError(f"{where}.params[{j}] may set only {', '.join(RESAMPLE_KEYS)}, got {params!r}")
            if params.get("temperature", 1.0) <= 0 or not 0 < params.get("top_p", 1.0) <= 1:
                raise ValueError(f"{where}.params[{j}] needs temperature > 0 and top_p in (0, 1], got {params!r}")
        checked.append({"step": trigger["step"], "params": [dict(p) for p in trigger["params"]]})
    return sorted(checked, key=lambda t: t["step"])


def resample_plan(schedule: list[dict], step: int, temperature: float, top_p: float) -> list[dict]:
    """Sampling parameters of each allowed retry at training step `step` (1-based), the trigger in force being the
    last one whose step is <= `step`; keys a retry does not set keep the run's `temperature` / `top_p`. The upstream
    code applies a trigger one generation batch late (docs/methods.md 4.1); here it applies from its own step."""
    active = [t for t in schedule if t["step"] <= step]
    if not active:
        return []
    return [{"temperature": temperature, "top_p": top_p, **params} for params in active[-1]["params"]]


# ---------------------------------------------------------------------------------------------------------------------
# AGPO-DSF (Hu et al. 2026, wandugu/paper_agpo trainer.py; docs/methods.md 5.1-5.2, [CODE]): a probe group per prompt
# sets the temperature of its training group; the clip range of each group comes from the probe's statistics, the
# policy's entropy against its running reference, and the drift of the last update.

UNCERTAINTY_FLOOR = 1e-8  # config.yaml uncertainty_floor / clip_entropy_floor


@dataclass(frozen=True)
class DSFState:
    uncertainty_baseline: float = 0.0  # U-bar, running baseline of the probe uncertainty (0 = not yet set)
    entropy_ref: float = 0.0  # H-bar, running reference of the policy entropy (0 = not yet set)
    step_kl_ema: float = 0.0  # K-bar_step, moving average of KL(pi_old || pi_new) after each update


def vote_entropy(answers: list[str]) -> float:
    """E_vote = -sum_a p_a ln p_a over the distinct answers of a probe group (natural log). 0 when all agree."""
    counts = Counter(answers)
    n = len(answers)
    return -sum(c / n * math.log(c / n) for c in counts.values()) if n else 0.0


def dsf_uncertainty(dispersion: float, vote: float, skewness: float, cfg) -> float:
    """U = w_r sigma_p + w_e E_vote + w_k |kappa| of one probe group."""
    return cfg.dsf_w_r * dispersion + cfg.dsf_w_e * vote + cfg.dsf_w_k * abs(skewness)


def dsf_temperatures(state: DSFState, uncertainties: list[float], cfg) -> tuple[DSFState, list[float], list[float]]:
    """Adaptive temperature of each prompt's training group, prompts taken in order (upstream runs them one by one,
    each updating the baseline before the next). Returns (state, temperatures, centred uncertainties).

        first prompt (U-bar <= 1e-8):  c = 0, U-bar = U
        otherwise:  c = (U - U-bar) / (U-bar + 1e-8);  U-bar <- a U + (1 - a) U-bar     (a = dsf_ema_alpha; c uses
                    the old U-bar)
        tau = clip(tau_base (1 + lambda_temp c), tau_min, tau_max)     (tau_base = cfg.temperature)
    More uncertain than usual: hotter (explore); less: cooler.
    """
    baseline = state.uncertainty_baseline
    temperatures, centred = [], []
    for u in uncertainties:
        if baseline <= UNCERTAINTY_FLOOR:
            c, baseline = 0.0, u
        else:
            c = (u - baseline) / (baseline + UNCERTAINTY_FLOOR)
            baseline = cfg.dsf_ema_alpha * u + (1.0 - cfg.dsf_ema_alpha) * baseline
        centred.append(c)
        temperatures.append(_clip(cfg.temperature * (1.0 + cfg.dsf_lambda_temp * c), cfg.dsf_tau_min,
                                  cfg.dsf_tau_max))
    return dataclasses.replace(state, uncertainty_baseline=baseline), temperatures, centred


def dsf_clip_range(entropy: float, entropy_ref: float, dispersion: float, vote: float, skewness: float,
                   step_kl: float, cfg) -> float:
    """The clip range of one group (docs/methods.md 5.1 step 4):

        g_H = clip(max(H, 1e-8) / (max(H_ref, 1e-8) + 1e-8), h_min, h_max)
        eps = clip(eps_base g_H (1 + delta E_vote) / (1 + alpha_var sigma_p + gamma K_step + zeta |kappa|),
                   eps_min, eps_max)                                            (eps_base = cfg.epsilon)
    Wider when the policy is more uncertain than its reference or the probe answers disagree; narrower when rewards
    are spread, the last update drifted, or the rewards are skewed.
    """
    ratio = max(entropy, UNCERTAINTY_FLOOR) / (max(entropy_ref, UNCERTAINTY_FLOOR) + UNCERTAINTY_FLOOR)
    g_h = _clip(ratio, cfg.dsf_entropy_h_min, cfg.dsf_entropy_h_max)
    widen = cfg.epsilon * g_h * (1.0 + cfg.dsf_delta_probe_entropy * vote)
    narrow = 1.0 + cfg.dsf_alpha_var * dispersion + cfg.dsf_gamma_stepkl * step_kl + cfg.dsf_zeta_skew * abs(skewness)
    return _clip(widen / narrow, cfg.dsf_eps_min, cfg.dsf_eps_max)


def dsf_clip_ranges(state: DSFState, entropies: list[float], dispersions: list[float], votes: list[float],
                    skewnesses: list[float], cfg) -> tuple[DSFState, list[float]]:
    """Clip range per prompt group, in order; the entropy reference moves after each group (upstream order):
    H_ref = H-bar if set, else this group's H; then H-bar <- H (first) or a_H H + (1 - a_H) H-bar."""
    entropy_ref = state.entropy_ref
    ranges = []
    for h, sigma, vote, kappa in zip(entropies, dispersions, votes, skewnesses, strict=True):
        reference = entropy_ref if entropy_ref > UNCERTAINTY_FLOOR else h
        ranges.append(dsf_clip_range(h, reference, sigma, vote, kappa, state.step_kl_ema, cfg))
        entropy_ref = h if entropy_ref <= UNCERTAINTY_FLOOR else \
            cfg.dsf_entropy_ref_ema_alpha * h + (1.0 - cfg.dsf_entropy_ref_ema_alpha) * entropy_ref
    return dataclasses.replace(state, entropy_ref=entropy_ref), ranges


def update_step_kl(state: DSFState, step_kl: float, cfg) -> DSFState:
    """After a generation batch's update epochs: K_step <- a KL_step + (1 - a) K_step (a = dsf_step_kl_ema_alpha),
    with KL_step the mean over groups of max(0, token-mean(old_logp - new_logp)). Read by the next batch's clip."""
    return dataclasses.replace(state, step_kl_ema=cfg.dsf_step_kl_ema_alpha * step_kl
                               + (1.0 - cfg.dsf_step_kl_ema_alpha) * state.step_kl_ema)
