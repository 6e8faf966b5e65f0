"""The scaffold task: a verifier that requires the long preamble, two equally correct
forms, lengths that vary inside a group, and a shared prefix ≥ 60 % of response tokens."""

import pytest
import torch

import gradlab
from gradlab.cli.main import main
from gradlab.loop.config import RunConfig
from gradlab.loop.rollouts.rollout import generate
from gradlab.loop.setup.policy import SCAFFOLD_POLICY_DIR, build_tokenizer, load_policy
from gradlab.loop.setup.task import SCAFFOLD_PREAMBLE, ScaffoldTask, get_task
from gradlab.loop.train import train


def test_preamble_is_long_and_encodable():
    tok = build_tokenizer()
    ids = tok(SCAFFOLD_PREAMBLE, add_special_tokens=False)["input_ids"]
    assert len(ids) >= 16 and tok.unk_token_id not in ids
    task = ScaffoldTask()
    for p in task.problems(50, seed=0):
        for text in (p.prompt, *p.solutions):
            assert tok.unk_token_id not in tok(text, add_special_tokens=False)["input_ids"]


def test_the_verifier_requires_the_preamble():
    task = ScaffoldTask()
    p = task.make_problem([7, 5, 8])
    assert p.prompt == "7+5+8=?" and p.answer == "20"
    assert p.solutions == (SCAFFOLD_PREAMBLE + "7+5=12,12+8=20", SCAFFOLD_PREAMBLE + "8+5=13,13+7=20")
    for sol in p.solutions:
        assert task.reward(p, sol) == 1.0 and task.reward(p, "  " + sol + "\n") == 1.0
        work = sol[len(SCAFFOLD_PREAMBLE):]
        assert task.reward(p, work) == 0.0  # right work, no preamble
        assert task.reward(p, SCAFFOLD_PREAMBLE.replace("plan", "plam") + work) == 0.0
        assert task.reward(p, SCAFFOLD_PREAMBLE[:-10] + work) == 0.0  # a truncated plan
        assert task.extract_answer(work) == "20"  # the answer is right: only the plan is missing
    assert task.reward(p, SCAFFOLD_PREAMBLE + "7+5=12,12+8=21") == 0.0
    assert task.reward(p, SCAFFOLD_PREAMBLE + "7+13=20") == 0.0  # a skipped step
    assert task.reward(p, SCAFFOLD_PREAMBLE + "7+5=12,12+8=20,20+0=20") == 0.0  # an extra one


def test_two_forms_and_solution_form():
    task = ScaffoldTask()
    for p in task.problems(200, seed=1):
        terms = [int(x) for x in p.prompt[:-2].split("+")]
        assert 2 <= len(terms) <= 4 and terms[0] != terms[-1]
        f0, f1 = task.solutions(p)
        assert f0 != f1 and task.solution_form(p, f0) == 0 and task.solution_form(p, f1) == 1
        assert task.is_correct(p, f0) and task.is_correct(p, f1)
        assert f0.count("=") == f1.count("=") == len(terms) - 1  # one worked step per term
        assert task.solutions(type(p)(p.prompt, p.answer)) == [f0, f1]  # rebuilt from the prompt
        assert len(f0) + 1 <= task.max_new_tokens  # + EOS
    assert get_task("scaffold").key == "scaffold-t4"
    with pytest.raises(ValueError, match="max_terms"):
        ScaffoldTask(max_terms=1)


def test_lengths_vary_inside_a_group_and_with_the_term_count():
    task = ScaffoldTask()
    lens = {n: len(task.solutions(task.make_problem(list(range(1, n + 1))))[0]) for n in (2, 3, 4)}
    assert lens[2] < lens[3] < lens[4]  # correct responses: one step more per term
    assert (SCAFFOLD_POLICY_DIR / "model.safetensors").is_file()  # shipped: no warm start here
    model, tok = load_policy(task=task)
    g = torch.Generator().manual_seed(0)
    ro = generate(model, tok, task.problems(16, seed=2), 8, task.max_new_tokens, 1.0, generator=g,
                  task=task)
    L = ro.response_mask.sum(-1).float()
    sd = torch.stack([L[ro.group == k].std() for k in range(16)])
    assert (sd > 0).sum() >= 4 and sd.max() > 2  # groups hold responses of different lengths
    right, wrong = L[ro.rewards > 0], L[ro.rewards == 0]
    assert 0.15 <= len(right) / len(L) <= 0.7 and len(wrong) > 0
    assert abs(float(right.mean() - wrong.mean())) > 1.0  # wrong answers are not right-length


def test_shared_prefix_in_a_short_real_tandem(tmp_path):
    cfg = RunConfig(out=str(tmp_path / "s"), task="scaffold", objectives=["gspo", "dfpo-min"],
                    steps=1, prompts=4, G=8, minibatches=2, tax_every=1, progress=False,
                    probe_contexts=4, eval_size=8)
    train(cfg)
    wide = gradlab.load_run(tmp_path / "s", wide=True).set_index("objective")
    assert (wide["shared_frac_prefix"] >= 0.6).all()
    assert wide.loc["gspo", "tax_share"] > 1e-4 > wide.loc["dfpo-min", "tax_share"]
    assert {"logodds", "form0_share", "eval_accuracy", "attr_clip"} <= set(wide.columns)


def test_cli_accepts_scaffold(capsys):
    assert main(["tandem", "--out", "/tmp/x", "--task", "scaffolds"]) == 2
    assert "arithmetic, scaffold" in capsys.readouterr().err
