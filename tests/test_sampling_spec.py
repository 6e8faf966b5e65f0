"""`SamplingSpec`: built from a RunConfig, bad values named, and `layouts.sample` dispatching
on its layout (a tree of G roots is G independent samples keyed like `rollout.generate`)."""

import pytest
import torch

from gradlab.loop.config import RunConfig
from gradlab.loop.rollouts.layouts import sample
from gradlab.loop.rollouts.rollout import generate
from gradlab.loop.rollouts.spec import Decoding, SamplingSpec
from gradlab.loop.setup.policy import load_policy
from gradlab.loop.setup.task import ArithmeticTask


def test_from_config_reads_every_sampling_option():
    task = ArithmeticTask()
    cfg = RunConfig(G=6, temperature=0.7, rollout="tree", roots=1, branches=3,
                    branch_at="uniform", branch_token="alternative", repair="local",
                    repair_tries=2, amp=True)
    spec = SamplingSpec.from_config(cfg, task)
    assert spec == SamplingSpec(G=6, max_new_tokens=task.max_new_tokens, temperature=0.7,
                                layout="tree", roots=1, branches=3, branch_at="uniform",
                                branch_token="alternative", repair="local", repair_tries=2,
                                amp=True, max_prompt_len=None)
    assert spec.alternative and not SamplingSpec(2, 4).alternative
    assert SamplingSpec.from_config(RunConfig(max_new_tokens=5), task).max_new_tokens == 5
    with pytest.raises(AttributeError):
        spec.G = 3  # frozen


@pytest.mark.parametrize("bad, field", [({"layout": "star"}, "layout"),
                                        ({"branch_at": "middle"}, "branch_at"),
                                        ({"branch_token": "any"}, "branch_token"),
                                        ({"repair": "rewrite"}, "repair"),
                                        ({"G": 0}, "G"), ({"max_new_tokens": 0}, "max_new_tokens")])
def test_bad_values_name_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        SamplingSpec(**{"G": 4, "max_new_tokens": 8, **bad})


def test_sample_dispatches_on_the_layout():
    model, tok = load_policy()
    task = ArithmeticTask()
    problems = task.problems(3, 4)
    G, T = 4, task.max_new_tokens
    keys = torch.arange(len(problems) * G) + 77
    flat = generate(model, tok, problems, G, T, row_keys=keys, task=task)
    got = sample(model, tok, problems, SamplingSpec(G, T), keys, task)
    assert got.texts == flat.texts and torch.equal(got.old_logps, flat.old_logps)
    roots = sample(model, tok, problems, SamplingSpec(G, T, layout="tree", roots=G), keys, task)
    W = flat.response_ids.shape[1]
    assert torch.equal(roots.response_ids[:, :W], flat.response_ids) and roots.texts == flat.texts
    assert torch.equal(roots.parent, torch.full((len(problems) * G,), -1))
    tree = sample(model, tok, problems, SamplingSpec(G, T, layout="tree", roots=1), keys, task)
    assert int((tree.parent >= 0).sum()) == len(problems) * (G - 1)
    dec = Decoding.of(SamplingSpec(G, T, temperature=0.5), model, tok)
    assert (dec.max_new_tokens, dec.temperature, dec.n_vocab) == (T, 0.5, len(tok))
    assert tok.eos_token_id in dec.stops
