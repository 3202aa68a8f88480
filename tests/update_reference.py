"""The trainer's update recorded as it runs, and the same update computed again from the definitions, without lib/.

`recording(records)` wraps two of train_agrpo's phase functions (the real ones still run): `update_policy`, to keep
the batch and the values each optimizer step trains on, and `step_optimizer`, to keep the gradient the optimizer
receives (after every micro-batch's backward and the processes' all-reduce, before clipping). `expected_gradient`
recomputes that gradient from the step's completions with a plain Hugging Face forward of each whole sequence (no
shared prompt prefix, no chunking, no padding), the loss written out from its papers, and autograd; the tests
compare the two. Run as a script (`python tests/update_reference.py RECORD_PREFIX [RECORDS.pt] -- TRAINER_ARGS`,
alone or under `accelerate launch`), it trains with the recording on (and, given RECORDS.pt, with the samples of those
records: `ReplaySampler`) and saves each process's records to RECORD_PREFIX-<rank>.pt.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path

import torch

ROLLOUT_FIELDS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "is_truncated", "temperatures",
                  "prompt_index", "sampling_logps")


# ---- recording ------------------------------------------------------------------------------------------------------

@contextmanager
def recording(records: list[dict], keep_weights: bool = False):
    """While inside, every optimizer step of train_agrpo appends a record to `records`: this process's share of the
    generation batch (its rollout, advantages, loss mask, the global rewards), the rows of this step's slice, the
    values it trains with (beta, per-completion clip ranges), and the gradient it produced (`grads`, by parameter
    name; all-reduced over the processes, so the same on each); with `keep_weights`, the policy's weights before the
    step (`weights`), for steps that no checkpoint precedes (inside a generation batch)."""
    import train_agrpo

    update_policy, step_optimizer = train_agrpo.update_policy, train_agrpo.step_optimizer

    def update(run, batch, part, values):
        geo = run.geometry
        rows = slice(part * geo.local_completions, (part + 1) * geo.local_completions)
        roll = batch.rollout
        records.append({
            "part": part, "world": geo.world, "rank": run.accelerator.process_index,
            "micro_batches": run.cfg.gradient_accumulation_steps,
            "rollout": {k: (v.detach().cpu().clone() if isinstance(v := getattr(roll, k), torch.Tensor) else v)
                        for k in ROLLOUT_FIELDS},
            "rows": (rows.start, rows.stop),
            "advantages": batch.advantages.detach().cpu().clone(),
            "loss_mask": batch.loss_mask.detach().cpu().clone(),
            "total": batch.total.detach().cpu().clone(), "group_size": batch.group_size,
            "first": geo.first,
            "beta": values.beta,
            "epsilon_low": _cpu(values.epsilon_low), "epsilon_high": _cpu(values.epsilon_high),
        })
        if keep_weights:
            records[-1]["weights"] = {k: v.detach().cpu().clone() for k, v in run.policy.state_dict().items()}
        return update_policy(run, batch, part, values)

    def step(run, loss, skip_update, nonfinite):
        records[-1]["grads"] = {name: p.grad.detach().cpu().clone() for name, p in run.policy.named_parameters()
                                if p.grad is not None}
        return step_optimizer(run, loss, skip_update, nonfinite)

    train_agrpo.update_policy, train_agrpo.step_optimizer = update, step
    try:
        yield records
    finally:
        train_agrpo.update_policy, train_agrpo.step_optimizer = update_policy, step_optimizer


def _cpu(value):
    return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value


def train_recorded(argv: list[str], keep_weights: bool = False) -> list[dict]:
    """train_agrpo.main(argv) in this process with the recording on; its records, one per optimizer step."""
    import train_agrpo
    from accelerate.state import AcceleratorState

    records: list[dict] = []
    try:
        with recording(records, keep_weights):
            train_agrpo.main(argv)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)  # the next run builds its own Accelerator
    return records


# ---- the same samples in another launch -----------------------------------------------------------------------------

class ReplaySampler:
    """Gives each prompt the completions a recorded run sampled for it (whole groups, in their order), so that a run
    with another number of processes trains on exactly the same samples: the trainer's own sampler draws from one
    random stream per process, which no other process count reproduces. Only the sampling is replaced; rewards,
    advantages, masks, the update and its reductions run as in any launch. A recorded engine's own log-probs
    (sampling_logps, vLLM's) are replayed with its samples, for the importance-sampling correction."""

    def __init__(self, records: list[dict]):
        self.groups: dict[tuple, list[tuple]] = {}
        for record in records:
            roll = record["rollout"]
            for p in range(roll["prompt_ids"].shape[0]):
                key = tuple(roll["prompt_ids"][p][roll["prompt_mask"][p].bool()].tolist())
                rows = (roll["prompt_index"] == p).nonzero().squeeze(1).tolist()
                logps = roll.get("sampling_logps")
                self.groups[key] = [(roll["completion_ids"][i], roll["completion_mask"][i], roll["is_truncated"][i],
                                     roll["temperatures"][i], None if logps is None else logps[i]) for i in rows]

    def generate(self, prompt_ids, prompt_mask, num_generations, max_new_tokens, **_):
        from lib.sampling.rollout import Rollout

        counts = num_generations.tolist() if isinstance(num_generations, torch.Tensor) else \
            [num_generations] * prompt_ids.shape[0]
        rows, index = [], []
        for p, count in enumerate(counts):
            group = self.groups[tuple(prompt_ids[p][prompt_mask[p].bool()].tolist())]
            assert count == len(group), "the replayed launch must keep each prompt's group on one process"
            rows += group
            index += [p] * count
        width = max(int(mask.sum()) for _, mask, _, _, _ in rows)
        logps = [row[4] for row in rows]  # a vLLM run's own log-probs, replayed with its samples
        return Rollout(prompt_ids, prompt_mask, torch.stack([ids[:width] for ids, _, _, _, _ in rows]),
                       torch.stack([mask[:width] for _, mask, _, _, _ in rows]),
                       torch.stack([truncated for _, _, truncated, _, _ in rows]),
                       torch.stack([temps[:width] for _, _, _, temps, _ in rows]), torch.tensor(index),
                       None if logps[0] is None else torch.stack([lp[:width] for lp in logps]))

    def sync_weights(self, policy) -> None:
        """The samples are fixed: nothing to sync."""

    def sleep(self) -> None:
        pass

    def ready(self, policy) -> None:
        pass

    def close(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


@contextmanager
def replaying(records: list[dict]):
    """While inside, train_agrpo samples with a ReplaySampler of `records`, in place of the sampler it makes (the HF
    sampler, or with use_vllm its colocated vLLM engine: lib/sampling/engines.make_sampler; no engine is started)."""
    import train_agrpo

    make_sampler = train_agrpo.make_sampler
    train_agrpo.make_sampler = lambda *args, **kwargs: ReplaySampler(records)
    try:
        yield
    finally:
        train_agrpo.make_sampler = make_sampler


# ---- the update from its definitions --------------------------------------------------------------------------------

def load_model(folder, weights: dict | None = None) -> torch.nn.Module:
    """The model in `folder` (fp32, eval mode), with `weights` (a recorded state dict) in place of its own if given."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if weights is not None:
        model.load_state_dict(weights)
    return model


def completions(record: dict, end_ids: list[int], max_completion_length: int) -> list[dict]:
    """This record's completions as separate sequences: the prompt without its padding, the completion up to and
    including its first end token (all max_completion_length tokens where none came: truncated), the temperature of
    each token, and its place in the global batch. The lengths and truncation come from the token ids and the end
    tokens here, not from the trainer's masks."""
    roll, out = record["rollout"], []
    start, stop = record["rows"]
    ends = torch.tensor(end_ids)
    for i in range(start, stop):
        prompt_row = int(roll["prompt_index"][i])
        prompt = roll["prompt_ids"][prompt_row][roll["prompt_mask"][prompt_row].bool()]
        ids = roll["completion_ids"][i]
        hits = torch.isin(ids, ends).nonzero()
        truncated = len(hits) == 0
        length = max_completion_length if truncated else int(hits[0]) + 1
        sampling = roll["sampling_logps"]
        out.append({"row": i, "global_row": record["first"] + i, "prompt": prompt, "ids": ids[:length],
                    "temperatures": roll["temperatures"][i, :length].float(), "truncated": truncated,
                    "advantage": float(record["advantages"][i]),
                    "sampling_logp": None if sampling is None else sampling[i, :length].float(),
                    "epsilon_low": _row(record["epsilon_low"], i), "epsilon_high": _row(record["epsilon_high"], i)})
    return out


def _row(value, i):
    return float(value[i]) if isinstance(value, torch.Tensor) else float(value)


def sequence_logps(model, completion: dict, with_entropy: bool = False):
    """(log pi(o_t | q, o_<t) at each completion token, the entropy of each next-token distribution), both at the
    temperature the token was sampled at, from one forward of the whole unpadded sequence."""
    prompt, ids = completion["prompt"], completion["ids"]
    logits = model(torch.cat([prompt, ids])[None]).logits[0, len(prompt) - 1: len(prompt) - 1 + len(ids)].float()
    logp_all = torch.log_softmax(logits / completion["temperatures"][:, None], dim=-1)
    logp = logp_all.gather(1, ids[:, None])[:, 0]
    return logp, (-(logp_all.exp() * logp_all).sum(-1) if with_entropy else None)


def kl_estimate(logp, ref_logp, estimator: str):
    """Schulman's estimators of KL(pi || pi_ref) from tokens sampled from pi, with log r = log pi_ref - log pi."""
    log_r = ref_logp - logp
    k3 = log_r.exp() - log_r - 1  # DeepSeekMath eq. 4
    forward = log_r.exp() * log_r - log_r.exp() + 1  # KL(pi_ref || pi), reweighted to samples from pi
    return {"k1": -log_r, "k3": k3, "forward": forward, "symmetric": k3 + forward}[estimator]


def loss_mask_of(completion: dict, cfg: dict) -> torch.Tensor:
    """1 for each completion token the loss counts: every token, none of a truncated completion with
    mask_truncated_completions (DAPO's overlong filtering), none of a zero-advantage completion with AGPO's
    loss_mask_zero_advantage."""
    keep = not (cfg.get("mask_truncated_completions") and completion["truncated"])
    keep = keep and not (cfg.get("loss_mask_zero_advantage") and completion["advantage"] == 0)
    return torch.full((len(completion["ids"]),), float(keep))


def expected_loss(policy, reference, old_policy, records: list[dict], cfg: dict, end_ids: list[int],
                  importance_sampling: bool = False) -> torch.Tensor:
    """The step's loss over every process's share (`records`: one per process, the same step), from the definitions:
    per token -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A) (DeepSeekMath eq. 3; rho per sequence for GSPO),
    times the truncated importance weight min(pi_old / pi_sampler, C) where asked (Yao et al. 2025), + beta KL(pi ||
    pi_ref) - eta H(pi), reduced as loss_type says over the global batch. `old_policy` None: on-policy (pi_old = pi
    in value); `reference` None: no KL term."""
    per_row = []  # (sum of masked per-token losses, loss tokens, micro-batch id)
    length_cap = cfg["max_completion_length"]
    beta, eta = records[0]["beta"], cfg.get("eta", 0.0)
    for record in records:
        per_micro = (record["rows"][1] - record["rows"][0]) // record["micro_batches"]
        for k, c in enumerate(completions(record, end_ids, length_cap)):
            logp, entropy = sequence_logps(policy, c, with_entropy=eta > 0)
            with torch.no_grad():
                old = sequence_logps(old_policy, c)[0] if old_policy is not None else logp.detach()
            log_ratio = logp - old
            if cfg.get("importance_sampling_level") == "sequence":  # GSPO: one ratio per completion
                log_ratio = log_ratio.mean().expand_as(logp)
            ratio, a = log_ratio.exp(), c["advantage"]
            clipped = ratio.clamp(1 - c["epsilon_low"], 1 + c["epsilon_high"])
            per_token = -torch.minimum(ratio * a, clipped * a)
            if importance_sampling:
                weight = (old - c["sampling_logp"]).exp()
                per_token = per_token * weight.clamp(max=cfg["vllm_importance_sampling_clip_max"])
            if reference is not None and beta > 0:
                with torch.no_grad():
                    ref = sequence_logps(reference, c)[0]
                per_token = per_token + beta * kl_estimate(logp, ref, cfg.get("kl_estimator", "k3"))
            if eta > 0:
                per_token = per_token - eta * entropy
            mask = loss_mask_of(c, cfg)
            per_row.append(((per_token * mask).sum(), mask.sum(), (record["rank"], k // per_micro)))
    n, loss_type = len(per_row), cfg["loss_type"]
    if loss_type == "grpo":  # mean over completions of each completion's token mean
        return sum(s / max(float(t), 1.0) for s, t, _ in per_row) / n
    if loss_type == "dapo":  # token mean over the global batch
        return sum(s for s, _, _ in per_row) / max(float(sum(t for _, t, _ in per_row)), 1.0)
    if loss_type == "dr_grpo":  # sum over the batch / (completions x max_completion_length)
        return sum(s for s, _, _ in per_row) / (n * length_cap)
    if loss_type == "bnpo":  # token mean of each micro-batch, averaged over micro-batches and processes
        groups: dict = {}
        for s, t, key in per_row:
            groups.setdefault(key, []).append((s, t))
        return sum(sum(s for s, _ in g) / max(float(sum(t for _, t in g)), 1.0) for g in groups.values()) / len(groups)
    raise ValueError(loss_type)


def expected_gradient(policy_folder, records: list[dict], cfg: dict, end_ids: list[int], *, reference_folder=None,
                      old_folder=None, importance_sampling: bool = False, policy_weights: dict | None = None,
                      old_weights: dict | None = None) -> dict[str, torch.Tensor]:
    """The gradient of `expected_loss` with respect to the policy loaded from `policy_folder` (with `policy_weights`
    in place of its own, if given), by parameter name; pi_old likewise from `old_folder` / `old_weights`."""
    policy = load_model(policy_folder, policy_weights)
    reference = load_model(reference_folder) if reference_folder is not None else None
    old = load_model(old_folder, old_weights) if old_folder is not None else None
    loss = expected_loss(policy, reference, old, records, cfg, end_ids, importance_sampling)
    loss.backward()
    return {name: p.grad.clone() for name, p in policy.named_parameters() if p.grad is not None}


def flat(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([grads[k].flatten().double() for k in sorted(grads)])


def norm(grads: dict[str, torch.Tensor]) -> float:
    return float(torch.linalg.vector_norm(flat(grads)))


def relative_gap(got: dict, want: dict) -> float:
    """||got - want|| / ||want|| over every parameter (a name missing from one side counts as zeros)."""
    names = sorted(set(got) | set(want))
    a = torch.cat([got.get(k, torch.zeros_like(want.get(k, got.get(k)))).flatten().double() for k in names])
    b = torch.cat([want.get(k, torch.zeros_like(got.get(k, want.get(k)))).flatten().double() for k in names])
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp(min=1e-30))


if __name__ == "__main__":  # python tests/update_reference.py RECORD_PREFIX [REPLAYED_RECORDS] -- TRAINER_ARGS
    from contextlib import nullcontext

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    split = sys.argv.index("--")
    prefix, replayed, argv = sys.argv[1], sys.argv[2:split], sys.argv[split + 1:]
    import train_agrpo  # noqa: F401 - imported before the recording wraps its functions

    steps: list[dict] = []
    with recording(steps), (replaying(torch.load(replayed[0], weights_only=False)) if replayed else nullcontext()):
        train_agrpo.main(argv)
    torch.save(steps, f"{prefix}-{steps[0]['rank'] if steps else 0}.pt")
