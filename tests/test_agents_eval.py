"""Evaluations with tools (docs/agents.md 7): lib/evaluation/accuracy.generate_and_score runs whole episodes, the evaluator's
KL and entropy count the model's tokens only, and eval_agrpo.py --tools writes the calls, on a model taught to call
a tool (the fixture tool_caller, tests/conftest.py)."""

import json

import pytest
import torch

from lib.data.word_problems import builtin_task
from lib.evaluation.accuracy import generate_and_score, summarize
from lib.agents.episodes import Agent
from lib.evaluation.metrics import completion_kl_entropy
from lib.agents.tools import ResultRenderer, ToolWorker, tool_schemas
from lib.models.modeling import completion_logps, load_policy, load_tokenizer
from lib.data.records import tokenize_prompts
from lib.sampling.rollout import HFRollout
from test_agents import TOOLS  # tool_caller: the fixture in tests/conftest.py


@pytest.fixture(scope="module")
def scored(tool_caller):
    tok = load_tokenizer(tool_caller)
    model = load_policy(tool_caller)
    worker = ToolWorker([f"{TOOLS}:add"], timeout=5.0)
    worker.start()
    agent = Agent(tok, worker.call, 2, 64, tool_schemas([f"{TOOLS}:add"]))
    records = builtin_task(seed=0, num_train=4, num_eval=0)[0]
    system, kwargs = agent.prompt_settings(None, None)
    from lib.data.records import DEFAULT_INSTRUCTION, format_prompt
    prompts = [format_prompt(tok, r["problem"], DEFAULT_INSTRUCTION, system, kwargs) for r in records]
    engine = HFRollout(model, [tok.eos_token_id], tok.pad_token_id, seed=0)
    try:
        results = generate_and_score(engine, tok, records, prompts, max_new_tokens=64, max_prompt_length=512,
                                     episodes=agent)
        plain = generate_and_score(engine, tok, records, prompts, max_new_tokens=64, max_prompt_length=512)
    finally:
        worker.close()
    return tok, model, prompts, results, plain


def test_evaluation_runs_episodes_and_marks_the_tools_tokens(scored):
    tok, _, _, results, plain = scored
    result_ids = ResultRenderer(tok).ids(["5"])
    for r, p in zip(results, plain):
        [ids], [model], [calls] = r["token_ids"], r["model_mask"], r["tool_calls"]
        assert calls == 1 and "tool\n5" in r["completions"][0]
        start = next(k for k in range(len(ids)) if ids[k:k + len(result_ids)] == result_ids)
        # the result's tokens are the tool's, every other token the model's, and "lengths" count the model's
        assert model == [1] * start + [0] * len(result_ids) + [1] * (len(ids) - start - len(result_ids))
        assert r["lengths"] == [sum(model)] < [len(ids)]
        # without the agent: the first turn alone, the same greedy tokens as the episode's first turn
        assert "model_mask" not in p and p["token_ids"][0] == ids[:start]
    assert summarize(results)["tool_calls"] == 1.0 and "tool_calls" not in summarize(plain)


def test_the_evaluators_kl_and_entropy_count_the_models_tokens_only(scored):
    tok, model, prompts, results, _ = scored
    kl, entropy = completion_kl_entropy(model, model, tok, prompts, results, temperature=0.0, max_prompt_length=512)
    # the per-token entropies of each episode (every token read), averaged over the model's tokens alone
    total = count = 0.0
    for prompt, r in zip(prompts, results):
        [ids], [kept] = r["token_ids"], r["model_mask"]
        p_ids, p_mask = tokenize_prompts(tok, [prompt], 512, "cpu")
        _, ent = completion_logps(model, p_ids, p_mask, torch.tensor([0]), torch.tensor([ids]),
                                  torch.ones(1, len(ids), dtype=torch.long), torch.ones(1))
        total += float((ent[0] * torch.tensor(kept, dtype=ent.dtype)).sum())
        count += sum(kept)
    assert kl == 0.0 and entropy == pytest.approx(total / count, rel=1e-5)
    every = [{**r, "model_mask": [[1] * len(r["token_ids"][0])]} for r in results]
    assert completion_kl_entropy(model, model, tok, prompts, every, temperature=0.0,
                                 max_prompt_length=512)[1] != pytest.approx(entropy, rel=1e-5)


def test_eval_agrpo_with_tools_writes_the_calls(tool_caller, tmp_path):
    import eval_agrpo

    out = tmp_path / "eval"
    [row] = eval_agrpo.main(["--model_name_or_path", tool_caller, "--max_samples", "4", "--tools", f"{TOOLS}:add",
                             "--max_completion_length", "64", "--bf16", "false", "--output_dir", str(out)])
    assert row["tool_calls"] == 1.0
    lines = [json.loads(x) for x in (out / "completions.jsonl").read_text().splitlines()]
    assert len(lines) == 4 and all(x["tool_calls"] == 1 and "tool\n5" in x["completion"] for x in lines)
    with pytest.raises(eval_agrpo.EvalConfigError, match="--tools: .*has no attribute 'nope'"):
        eval_agrpo.main(["--tools", f"{TOOLS}:nope", "--output_dir", str(tmp_path / "bad")])
