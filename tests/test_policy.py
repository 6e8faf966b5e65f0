"""Tokenizer, model configs, warm start, save/load and evaluation of the tiny policies."""

import shutil
from pathlib import Path

import pytest
import torch
from tolerance import assert_close_f32
from transformers import AutoTokenizer

from gradlab.loop.rollouts.rollout import encode_pairs
from gradlab.loop.setup import policy, shipped
from gradlab.loop.setup.policy import (
    ACCURACY_BAND,
    build_tokenizer,
    evaluate,
    load_policy,
    new_model,
    save_policy,
    tiny_config,
    warm_start,
)
from gradlab.loop.setup.task import ArithmeticTask, JsonlTask, ScaffoldTask


@pytest.fixture(scope="module")
def default_policy():
    return load_policy()


def test_tokenizer_round_trip(tmp_path):
    tok = build_tokenizer()
    text = "so 34+57=91"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)  # one token per char
    assert tok.decode(ids) == text
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    assert tok("é")["input_ids"] == [tok.unk_token_id]
    tok.save_pretrained(tmp_path)
    tok2 = AutoTokenizer.from_pretrained(tmp_path)
    assert tok2.padding_side == "left" and len(tok2) == len(tok)
    assert tok2(text)["input_ids"] == ids and tok2.decode(ids) == text
    batch = tok2(["1+2=?", "10+20=?"], padding=True)
    assert batch["input_ids"][0][:2] == [0, 0] and batch["attention_mask"][0][:2] == [0, 0]


def test_configs():
    tiny = new_model(build_tokenizer())
    assert sum(p.numel() for p in tiny.parameters()) < 200_000
    cfg = tiny_config(99, "25m")
    with torch.device("meta"):
        big = type(tiny)(cfg)
    assert 20e6 < sum(p.numel() for p in big.parameters()) < 30e6
    with pytest.raises(ValueError, match="tiny"):
        tiny_config(99, "huge")


def test_default_policy_in_band(default_policy):
    model, tok = default_policy
    task = ArithmeticTask()
    m = evaluate(model, tok, task, n=512, temperature=1.0, seed=123)
    assert ACCURACY_BAND[0] <= m["accuracy"] <= ACCURACY_BAND[1]
    assert m["form0_share"] > 0.05 and m["form1_share"] > 0.05  # samples both forms
    assert m["form0_share"] + m["form1_share"] == pytest.approx(m["accuracy"])  # strict reward
    assert 10 <= m["mean_length"] <= task.max_new_tokens


def test_warm_start_reaches_band():
    model, tok, info = warm_start(ArithmeticTask(), seed=0, progress=False)
    assert info["in_band"], info
    assert ACCURACY_BAND[0] <= info["accuracy"] <= ACCURACY_BAND[1]
    assert info["steps"] > 0 and info["seconds"] < 120
    again = evaluate(model, tok, ArithmeticTask(), n=256, seed=99)["accuracy"]
    assert ACCURACY_BAND[0] - 0.05 <= again <= ACCURACY_BAND[1] + 0.05


def test_warm_start_deterministic():
    a, _, ia = warm_start(ArithmeticTask(), seed=3, steps=8, progress=False)
    b, _, ib = warm_start(ArithmeticTask(), seed=3, steps=8, progress=False)
    c, _, _ = warm_start(ArithmeticTask(), seed=4, steps=8, progress=False)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)
    assert ia["steps"] == 8 and ia["accuracy"] == ib["accuracy"]


def test_warm_start_on_jsonl_with_some_solutions():
    tiny = JsonlTask(Path(__file__).parent / "data" / "tiny_task.jsonl")  # 3 of 5 lines solved
    _, _, info = warm_start(tiny, steps=3, progress=False)
    assert info["steps"] == 3 and info["task"] == tiny.key


def test_warm_start_needs_solutions(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text('{"prompt": "a=?", "answer": "1"}\n')
    with pytest.raises(ValueError, match="solutions"):
        warm_start(JsonlTask(f), progress=False)


def test_save_and_load(tmp_path, default_policy):
    model, tok = default_policy
    save_policy(model, tok, tmp_path / "p", info={"note": "test"})
    assert (tmp_path / "p" / "model.safetensors").is_file()
    m2, t2 = load_policy(tmp_path / "p")
    ids = torch.tensor([tok("12+34=?so 12")["input_ids"]])
    assert_close_f32(m2(ids).logits, model(ids).logits)
    assert t2.padding_side == "left" and t2.eos_token_id == tok.eos_token_id


def test_load_missing_path(tmp_path):
    missing = tmp_path / "no_such_policy"
    with pytest.raises(FileNotFoundError, match="no_such_policy"):
        load_policy(missing)


def test_load_policy_caches_warm_start(tmp_path, monkeypatch):
    calls = []

    def fake_warm_start(task, **kw):
        calls.append(task.key)
        tok = build_tokenizer()
        return new_model(tok), tok, {"task": task.key}

    monkeypatch.setattr(policy, "warm_start", fake_warm_start)
    task = ArithmeticTask(difficulty=1)
    load_policy(task=task, cache_dir=tmp_path)
    load_policy(task=task, cache_dir=tmp_path)
    assert calls == ["arithmetic-d1"]  # second call hits the cache
    assert (tmp_path / "arithmetic-d1-seed0" / "model.safetensors").is_file()


@pytest.mark.parametrize("task, missing", [(None, "model.safetensors"),
                                            (ArithmeticTask(), "tokenizer.json"),
                                            (ScaffoldTask(), "config.json")])
def test_missing_shipped_policy_is_an_error_not_a_warm_start(tmp_path, monkeypatch, task, missing):
    """A shipped policy with a file missing from the install: MissingPolicyError (a
    FileNotFoundError) naming the file and how to restore it; no warm start, nothing cached."""
    def no_warm_start(*a, **kw):
        raise AssertionError("warm start in place of the shipped policy")

    monkeypatch.setattr(policy, "warm_start", no_warm_start)
    key = (task or ArithmeticTask()).key
    folder, regenerate = shipped.SHIPPED_POLICIES[key]
    copy = tmp_path / folder.name
    shutil.copytree(folder, copy)
    (copy / missing).unlink()
    monkeypatch.setitem(shipped.SHIPPED_POLICIES, key, (copy, regenerate))
    with pytest.raises(FileNotFoundError) as e:
        load_policy(task=task, cache_dir=tmp_path / "cache")
    assert isinstance(e.value, shipped.MissingPolicyError)
    msg = str(e.value)
    assert str(copy / missing) in msg and "\n" not in msg
    assert f"git checkout -- gradlab/data/{folder.name}" in msg and regenerate in msg
    assert not (tmp_path / "cache").exists()


def test_shipped_policies_are_the_tasks_own():
    """The torch-free table of shipped policies names the keys the tasks compute, and every
    file `load_policy` reads is in the install."""
    assert set(shipped.SHIPPED_POLICIES) == {ArithmeticTask().key, ScaffoldTask().key}
    for key in shipped.SHIPPED_POLICIES:
        shipped.check_shipped_policy(key)


def test_a_tokenizer_without_pad_or_eos_is_refused_by_name(tmp_path, default_policy):
    """No pad token: padded with EOS (padding is masked out); neither: a ConfigError naming the
    folder, not a failure deep in the first rollout."""
    from gradlab.loop.config import ConfigError

    model, _ = default_policy
    for name, keep_eos in (("eos", True), ("none", False)):
        tok = build_tokenizer()
        tok.pad_token = None
        if not keep_eos:
            tok.eos_token = None
        save_policy(model, tok, tmp_path / name)
    _, tok = load_policy(tmp_path / "eos")
    assert tok.pad_token_id == tok.eos_token_id == 1
    with pytest.raises(ConfigError, match=f"tokenizer in {tmp_path / 'none'} has neither a pad nor an EOS"):
        load_policy(tmp_path / "none")


def test_bf16_folder_loads_fp32_master_weights_with_sdpa(tmp_path, default_policy):
    """A bf16 checkpoint loads as float32 (exactly the stored values) with SDPA attention, so a
    small AdamW step moves weights that bf16 would round back (1.0 - 2e-4 is 1.0 in bf16)."""
    model, tok = default_policy
    bf16 = new_model(tok, seed=1).to(torch.bfloat16)
    save_policy(bf16, tok, tmp_path / "bf16")
    m, _ = load_policy(tmp_path / "bf16")
    assert {p.dtype for p in m.parameters()} == {torch.float32}
    assert m.config._attn_implementation == "sdpa"
    for (n, p), (_, q) in zip(m.named_parameters(), bf16.named_parameters()):
        assert torch.equal(p, q.float()), n
    pi, pm, ri, rm = encode_pairs(tok, ["12+34=?", "1+2=?"], ["so 12+34=46", "so 1+2=3"])
    eager = new_model(tok, seed=1)
    eager.load_state_dict({k: v.float() for k, v in bf16.state_dict().items()})
    from gradlab.loop.numerics.logprobs import token_logps
    assert_close_f32(token_logps(m, pi, pm, ri, rm), token_logps(eager, pi, pm, ri, rm))
    m.train()
    opt = torch.optim.AdamW(m.parameters(), lr=2e-4, weight_decay=0.0)
    norm = m.model.norm.weight
    before = norm.detach().clone()
    (-token_logps(m, pi, pm, ri, rm).sum()).backward()
    opt.step()
    assert (norm.detach() != before).float().mean() > 0.9  # fp32: the step is not rounded away
    assert torch.equal(norm.detach().bfloat16().float(), before)  # bf16 would have lost it
