"""Which causal LM architectures agrpo trains on their own distribution, measured on small random models.

    python scripts/architectures.py --families     # the families docs/models.md names: log-prob gaps before and after
    python scripts/architectures.py                # every causal LM architecture of transformers: built small, checked

`--families`: for each family, a two-block model with random (seeded) weights is built from its config (vocabulary
96, hidden size 32), and the per-token log-probs of fixed completions are compared with log_softmax of the model's
own forward logits (temperature 1): "before" with the output layer alone (what the scorer and the sampler's first
token used until the logit post-processing was added), "after" with the scorer (`lib.models.modeling.completion_logps`).
Twice: with the weights as initialised (raw logits below 1) and with the output layer scaled so the raw logits reach
about +-40, as a trained model's do.

Without `--families`: every architecture in transformers' causal-LM mapping is built small from its config class
(common size keys shrunk; 4 or 8 blocks where 2 hold no attention block; an architecture whose own forward does not
run at these sizes is listed as not built) and given to
`lib.models.modeling.check_scoring_path`, the check every model passes when it loads: "ok" (with the post-processing
applied), or "refused" with the reason. Markdown tables on stdout (docs/models.md quotes them).
"""

from __future__ import annotations

import argparse
import inspect
import sys
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: E402
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402

from lib.models.modeling import check_scoring_path, completion_logps, logit_transform, positions_from_mask  # noqa: E402

FAMILY_SIZE = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
                   eos_token_id=2)
# the post-processing values of the published models (Gemma-2: soft cap 30; granite-3.x: logits_scaling 8;
# command-r: logit_scale 0.0625); Gemma-3's checkpoints have no soft cap
FAMILIES = {
    "Llama": ("LlamaConfig", {}), "Qwen2": ("Qwen2Config", {}), "Qwen3": ("Qwen3Config", {}),
    "Gemma-2": ("Gemma2Config", {"final_logit_softcapping": 30.0}), "Gemma-3": ("Gemma3TextConfig", {}),
    "Granite": ("GraniteConfig", {"logits_scaling": 8.0}), "Phi-3": ("Phi3Config", {}),
    "Mistral": ("MistralConfig", {}), "Cohere": ("CohereConfig", {"logit_scale": 0.0625}),
}

# size keys shrunk in every config that has them (under its own name, through the config's attribute_map)
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=128, max_position_embeddings=128, moe_intermediate_size=32,
             shared_expert_intermediate_size=32, num_experts=4, num_local_experts=4, n_routed_experts=4,
             num_experts_per_tok=2, n_shared_experts=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
             qk_nope_head_dim=8, v_head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2,
             decoder_start_token_id=0, first_k_dense_replace=1, num_nextn_predict_layers=0)


def gaps(model: torch.nn.Module) -> tuple[str, str]:
    """(before, after): the mean and the largest per-token gap, in nats, between the model's own log-probs and those
    of the raw output layer (before) and of the scorer (after), on two left-padded prompts and three completions."""
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    prompt = torch.randint(3, vocab, (2, 7), generator=g)
    prompt_mask = torch.ones_like(prompt)
    prompt_mask[1, :2] = 0
    index = torch.tensor([0, 0, 1])
    completion = torch.randint(3, vocab, (3, 6), generator=g)
    ids = torch.cat([prompt[index], completion], 1)
    mask = torch.cat([prompt_mask[index], torch.ones_like(completion)], 1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask)).logits[:, 6:-1]
        hidden = model.get_decoder()(input_ids=ids, attention_mask=mask,
                                     position_ids=positions_from_mask(mask)).last_hidden_state[:, 6:-1]
        raw = model.get_output_embeddings()(hidden)

        def logps(values):
            return torch.log_softmax(values.float(), -1).gather(-1, completion[..., None]).squeeze(-1)

        own = logps(logits)
        after, _ = completion_logps(model, prompt, prompt_mask, index, completion, torch.ones_like(completion),
                                    torch.ones(3), with_entropy=False)
    def text(gap: torch.Tensor) -> str:
        return f"{float(gap.abs().mean()):.2g} / {float(gap.abs().max()):.2g}"

    return text(logps(raw) - own), text(after - own)


def families() -> None:
    print("| family | post-processing | as initialised, before | after | raw logits to +-40, before | after |")
    print("|---|---|---|---|---|---|")
    for family, (config_name, extra) in FAMILIES.items():
        torch.manual_seed(0)
        config = getattr(transformers, config_name)(**FAMILY_SIZE, **extra)
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        initialised = gaps(model)
        scale, cap = logit_transform(model.config)
        with torch.no_grad():
            probe = model(input_ids=torch.arange(3, 40)[None]).logits
            model.get_output_embeddings().weight.mul_(40 / float(probe.abs().max() / scale))
        trained_like = gaps(model)
        post = ", ".join(([f"x {scale:g}"] if scale != 1 else []) + ([f"soft cap {cap:g}"] if cap else [])) or "none"
        print(f"| {family} | {post} | {' | '.join(initialised)} | {' | '.join(trained_like)} |")


def small_config(config_class, layers: int = 2, depth: int = 0):
    """A config of `config_class` with the SMALL sizes and `layers` blocks (sub-configs shrunk too), or raise."""
    default = config_class()
    accepted = set(inspect.signature(config_class.__init__).parameters)
    kwargs = {}
    for key, value in {**SMALL, "num_hidden_layers": layers}.items():
        name = getattr(default, "attribute_map", {}).get(key, key)
        if name in accepted or (hasattr(default, name) and getattr(default, name) is not None):
            kwargs[name] = value
    for key, sub_class in getattr(config_class, "sub_configs", {}).items():
        if depth < 2 and getattr(default, key, None) is not None and inspect.isclass(sub_class):
            try:
                kwargs[key] = small_config(sub_class, layers, depth + 1).to_dict()
            except Exception:  # noqa: BLE001  (keep the default sub-config)
                pass
    return config_class(**kwargs)


def build(model_type: str, class_name: str, layers: int):
    """A small random model of one architecture, whose own forward runs on a padded batch like the check's; or
    raise."""
    model_class = getattr(transformers, class_name)
    config = small_config(CONFIG_MAPPING[model_type], layers)
    with torch.device("meta"):
        size = sum(p.numel() for p in model_class(config).parameters())
    if size > 40_000_000:
        raise ValueError(f"{size / 1e6:.0f}M parameters at the small sizes")
    torch.manual_seed(0)
    model = model_class(config).eval()
    ids = torch.arange(3, 21).view(2, 9)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # the check's input: two rows, one left-padded
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask))
    return model


def survey() -> None:
    rows = []
    for model_type, class_name in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()):
        # 2 blocks, or 4 and 8 for hybrids whose first blocks are all recurrent (attention every 4th or 8th block);
        # the best outcome is kept: ok, else refused, else not built
        row = None
        for layers in (2, 4, 8):
            try:
                model = build(model_type, class_name, layers)
            except Exception as error:  # noqa: BLE001
                if row is None:
                    row = (model_type, class_name, "not built", f"{type(error).__name__}: {str(error)[:90]}")
                continue
            try:
                check_scoring_path(model)
            except ValueError as error:
                reason = str(error).split(f"{class_name} ", 1)[-1].split("; supported architectures")[0]
                row = (model_type, class_name, "refused", reason[:160])
                continue
            scale, cap = logit_transform(model.config)
            post = ", ".join(([f"x {scale:g}"] if scale != 1 else []) + ([f"soft cap {cap:g}"] if cap else []))
            row = (model_type, class_name, "ok", post + (f" ({layers} blocks)" if layers > 2 else ""))
            break
        rows.append(row)
        print(f"{model_type}: {row[2]}", file=sys.stderr, flush=True)
    counts = {kind: sum(r[2] == kind for r in rows) for kind in ("ok", "refused", "not built")}
    print(f"{len(rows)} architectures: {counts['ok']} ok, {counts['refused']} refused, {counts['not built']} not built")
    print()
    print("| model_type | class | result | post-processing, or why |")
    print("|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(cell.replace("|", "/").replace("\n", " ") for cell in row) + " |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", action="store_true", help="Only the named families, with log-prob gaps.")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    families() if args.families else survey()


if __name__ == "__main__":
    main()
