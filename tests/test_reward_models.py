"""Reward models (lib/models/reward_models.py) on a small random-weight LlamaForSequenceClassification saved with the embedded
model's tokenizer: a completion's score is the model's own forward on the conversation in its chat template, in
batches, and a training run on the tiny policy scores and logs with it (docs/methods.md 2.5)."""

import math

import pytest
import torch

from conftest import assert_close_to_scale
from lib.models.reward_models import RewardModelSpec, load_reward_models, reward_model_spec
from lib.rewards.scoring import resolve_reward_funcs, reward_arguments, score_completions
from test_loop import REWARDS, train

TRL_STYLE = REWARDS.replace("tiny_rewards.py", "trl_style_rewards.py")


@pytest.fixture(scope="module")
def tiny_reward_model(tmp_path_factory, embedded_model) -> str:
    """A folder `tiny_rm`: a two-block Llama with a one-score head (num_labels=1, pad_token_id set), random (seeded)
    weights, and the embedded model's tokenizer, which has a chat template."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from lib.models.modeling import load_tokenizer

    tokenizer = load_tokenizer(embedded_model)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("reward_models") / "tiny_rm"
    LlamaForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def own_forward(model, tokenizer, text: str) -> float:
    inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        return float(model(**inputs).logits[0, 0])


def test_a_completion_scores_what_the_model_itself_gives_its_conversation(tiny_reward_model):
    [(name, spec)] = resolve_reward_funcs([tiny_reward_model], models=reward_model_spec)
    assert (name, spec) == ("tiny_rm", RewardModelSpec(tiny_reward_model))
    [(name, rm)] = load_reward_models([(name, spec)], "cpu", batch_size=2, instruction="Answer: <number>")
    assert rm.__name__ == "tiny_rm" and not rm.model.training
    assert not any(p.requires_grad for p in rm.model.parameters())
    batches = []
    rm.model.register_forward_hook(lambda module, args, kwargs, out: batches.append(kwargs["input_ids"].shape),
                                   with_kwargs=True)
    chat = {"prompt": [{"role": "user", "content": "What is 2+2?"}], "answer": "4"}
    plain = {"problem": "What is 3+3?", "answer": "6"}
    records = [chat, chat, plain]
    texts = ["4", "It is 4, since two and two make four.", "Let me think. Three and three: six.\nAnswer: 6"]
    prompts, completions, columns = reward_arguments(records, [None, None, "<|im_start|>user\nWhat is 3+3?..."], texts)
    [scores], errors = score_completions([(name, rm)], prompts, completions, columns, records=records)
    assert errors == {"tiny_rm": 0}
    assert [shape[0] for shape in batches] == [2, 1]  # batch_size 2: two padded forwards
    # the model's own forward, one text at a time, no padding: the conversation in the reward model's template
    conversation_of = [chat["prompt"], chat["prompt"],
                       [{"role": "user", "content": "What is 3+3?\nAnswer: <number>"}]]
    expected = [own_forward(rm.model, rm.tokenizer, rm.tokenizer.apply_chat_template(
        [*conv, {"role": "assistant", "content": text}], tokenize=False)) for conv, text in zip(conversation_of, texts)]
    assert_close_to_scale(torch.tensor(scores), torch.tensor(expected), 1e-5, "reward model scores")
    assert len({round(s, 4) for s in scores}) == 3  # three texts, three scores: a head that reads them
    # TRL's plain form (a prompt given as text): the text + the completion, no template; and a tokenizer without a
    # template reads each message on its line
    assert rm(prompts=["Q: 1+1?\n"], completions=["2"]) == pytest.approx(
        [own_forward(rm.model, rm.tokenizer, "Q: 1+1?\n2")], rel=1e-5)
    rm.tokenizer.chat_template = None
    assert rm.text([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}], "C") == "S\nU\nC"


@pytest.mark.parametrize("key", ["reward_model_name_or_path", "reward_funcs"])
def test_a_training_run_scores_with_the_reward_model_and_logs_it(tiny_model, tiny_reward_model, tmp_path, key):
    # beside functions in the reward worker (reward_timeout 300 by default): the model scores in the trainer,
    # and the functions get completion_ids and trainer_state there
    funcs = [f"{REWARDS}:has_x", f"{TRL_STYLE}:steps_done", f"{TRL_STYLE}:token_count"]
    args = (["--reward_model_name_or_path", tiny_reward_model, "--reward_funcs", *funcs] if key != "reward_funcs"
            else ["--reward_funcs", tiny_reward_model, *funcs])
    steps = train(tiny_model, tmp_path / "run", *args, "--reward_weights", "1", "1", "0", "0",
                  "--correctness_reward", "has_x")
    assert len(steps) == 2
    for m in steps:
        assert m["rewards/tiny_rm/errors"] == 0 and math.isfinite(m["rewards/tiny_rm/mean"])
        assert m["rewards/tiny_rm/std"] > 0  # a random head gives each completion its own score
        assert m["rewards/token_count/mean"] == pytest.approx(m["completions/mean_length"])
    assert [m["rewards/steps_done/mean"] for m in steps] == [0.0, 1.0]  # trainer_state.global_step, batch by batch
