"""`gradlab eval`'s engine: the exact expected accuracy against an independent forward and
against many samples; the whole held-out split; run, checkpoint and model folders."""

import numpy as np
import pytest
import torch

from gradlab.loop.config import RunConfig
from gradlab.loop.recipes.evaluation import (
    evaluate_path,
    expected_accuracy,
    heldout_draw,
    heldout_split,
    sampled_accuracy,
)
from gradlab.loop.setup.heldout import eval_problems, is_heldout
from gradlab.loop.setup.policy import load_policy
from gradlab.loop.setup.task import ArithmeticTask, ScaffoldTask
from gradlab.loop.train import train


@pytest.fixture(scope="module")
def policy():
    task = ArithmeticTask()
    model, tok = load_policy(None, task=task)
    return model, tok, task


def _brute(model, tok, prompt: str, response: str, temperature: float) -> float:
    """π(response, EOS | prompt) from one plain forward of the unpadded sequence."""
    p = tok(prompt, add_special_tokens=False)["input_ids"]
    r = tok(response, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    ids = torch.tensor([p + r])
    with torch.no_grad():
        logits = model(ids).logits[0].double() / temperature  # (L, V)
    lp = torch.log_softmax(logits, -1)
    return float(sum(lp[len(p) + i - 1, t] for i, t in enumerate(r)).exp())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_expected_accuracy_equals_a_plain_forward(policy, temperature):
    model, tok, task = policy
    probs = heldout_draw(task, 6, seed=2)
    got = expected_accuracy(model, tok, task, probs, temperature)
    want = [sum(_brute(model, tok, p.prompt, s, temperature) for s in task.solutions(p))
            for p in probs]
    assert got == pytest.approx(want, rel=1e-4, abs=1e-7)


def test_expected_accuracy_is_the_limit_of_sampling(policy):
    model, tok, task = policy
    probs = heldout_draw(task, 24, seed=3)
    e = expected_accuracy(model, tok, task, probs)
    s = sampled_accuracy(model, tok, task, probs, samples=96, temperature=1.0, seed=5)
    se = np.sqrt((e * (1 - e)).sum() / 96) / len(e)
    assert abs(s.mean() - e.mean()) < 4 * se + 1e-3, (s.mean(), e.mean(), se)


def test_whole_heldout_split_and_draws():
    for task in (ArithmeticTask(), ScaffoldTask()):
        split = heldout_split(task)
        prompts = [p.prompt for p in split]
        assert len(set(prompts)) == len(prompts) and all(is_heldout(p) for p in prompts)
        assert 0.10 < len(split) / len(task.all_problems()) < 0.15
        assert heldout_draw(task, "all") == split
    task = ArithmeticTask()
    assert heldout_draw(task, 16, seed=0) == eval_problems(task, 16)  # the loop's own set
    other = heldout_draw(task, 16, seed=1)
    assert all(is_heldout(p.prompt) for p in other) and other != heldout_draw(task, 16, seed=0)
    with pytest.raises(ValueError, match="--problems"):
        heldout_draw(task, 0)
    with pytest.raises(ValueError, match="too many problems to list"):
        heldout_split(ArithmeticTask(difficulty=5))


def test_evaluate_run_checkpoint_and_model_folders(tmp_path, policy):
    model, tok, _ = policy
    cfg = RunConfig(out=str(tmp_path / "run"), objectives=["grpo", "gspo"], steps=1, prompts=2,
                    G=4, minibatches=1, tax_every=0, instruments="cheap", probe_contexts=2,
                    eval_every=1, eval_size=8, progress=False, threads=1)
    train(cfg)
    df = evaluate_path(tmp_path / "run", problems=8, samples=2, seed=0)
    assert set(df["policy"]) == {"grpo", "gspo"}
    assert set(df["metric"]) == {"accuracy_greedy", "accuracy_sampled", "accuracy_expected"}
    assert df["value"].between(0, 1).all() and (df["n_problems"] == 8).all()
    # the loop's eval_accuracy_expected is the checkpoint's expected accuracy on the same set
    import gradlab
    logged = gradlab.load_run(tmp_path / "run")
    logged = logged[logged["metric"] == "eval_accuracy_expected"].set_index("objective")["value"]
    exp = df[df["metric"] == "accuracy_expected"].set_index("policy")["value"]
    assert exp.loc["gspo"] == pytest.approx(logged.loc["gspo"], rel=1e-5)
    one = evaluate_path(tmp_path / "run" / "checkpoints" / "gspo", problems=8)
    assert set(one["policy"]) == {"gspo"}
    assert one.set_index("metric").loc["accuracy_expected", "value"] == pytest.approx(exp.loc["gspo"])
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    assert len(evaluate_path(folder, problems=4, task="arithmetic")) == 3
    with pytest.raises(ValueError, match="--objective 'dfpo'"):
        evaluate_path(tmp_path / "run", objective="dfpo")
    with pytest.raises(FileNotFoundError, match="neither a run folder"):
        evaluate_path(tmp_path / "nothing")
    with pytest.raises(ValueError, match="trained on 'arithmetic'"):
        evaluate_path(tmp_path / "run", task="scaffold")
