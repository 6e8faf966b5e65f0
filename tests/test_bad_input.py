"""Bad input gets a clear error naming the thing at fault, or a documented defined result."""

import math

import pytest
import torch

import gradlab
from gradlab import objectives
from gradlab.core.cancellation import cancellation
from gradlab.testing import measure_modulation, random_batch

ALL = ["grpo", "grpo-fix", "gspo", "gspo-token", "dfpo-min", "dfpo-orth", "dfpo-scale"]


def test_group_of_one_and_equal_rewards_give_zero_w_without_nan():
    b = random_batch(n_groups=2, G=3, T=6, seed=0, rewards=torch.ones(6))
    assert (b.advantages == 0).all()
    for name in ALL:
        W = objectives.get(name).modulation(b)
        assert torch.isfinite(W).all() and (W == 0).all(), name
        assert math.isnan(cancellation(W, b).ratio)  # W ≡ 0 at the nodes: undefined, not 0
    A = gradlab.advantages(torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 1, 1]))
    assert A[0] == 0  # a group of one


def test_orth_with_nearly_equal_advantages_is_finite():
    """Equal rewards across a subset give exactly equal A: the projection must be skipped."""
    r = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    b = random_batch(n_groups=1, G=7, T=8, seed=1, rewards=r, vocab=2)
    obj = objectives.get("dfpo", transform="orth", nodes="trie")
    W = obj.modulation(b)
    assert torch.isfinite(W).all() and W.abs().max() < 1.0


def test_empty_responses_and_all_padded_rows():
    b = random_batch(n_groups=2, G=3, T=6, seed=2)
    mask = b.mask.clone()
    mask[0] = False  # an all-padded (empty) row
    b = b.replace(mask=mask)
    for name in ALL:
        obj = objectives.get(name)
        W = obj.modulation(b)
        assert torch.isfinite(W).all() and (W[0] == 0).all()
        assert torch.isfinite(obj.loss(b))
        assert torch.allclose(W, measure_modulation(obj.loss, b), atol=1e-12)
    empty = b.replace(mask=torch.zeros_like(b.mask))
    assert math.isnan(cancellation(objectives.get("gspo").modulation(empty), empty).ratio)  # no node


@pytest.mark.parametrize("field", ["logps", "old_logps"])
def test_nan_logps_name_the_field_and_row(field):
    b = random_batch(seed=0)
    bad = getattr(b, field).clone()
    bad[2, 0] = float("nan")
    with pytest.raises(ValueError, match=rf"{field} is not finite at row 2, position 0"):
        b.replace(**{field: bad})
    # NaN at a padded position is ignored (padding is not part of the loss)
    pad = (~b.mask).nonzero()[0]
    ok = getattr(b, field).clone()
    ok[pad[0], pad[1]] = float("nan")
    b.replace(**{field: ok})


def test_nan_or_inf_reward_names_row_and_group():
    with pytest.raises(ValueError, match=r"row 2 \(group 1\) is inf"):
        gradlab.advantages(torch.tensor([1.0, 0.0, float("inf")]), torch.tensor([0, 0, 1]))
    with pytest.raises(ValueError, match="row 0"):
        gradlab.advantages(torch.tensor([float("nan")]), torch.tensor([0]))
    with pytest.raises(ValueError, match="scale"):
        gradlab.advantages(torch.ones(2), torch.zeros(2, dtype=torch.long), scale="bogus")


def test_mismatched_shapes_and_dtypes_name_the_field():
    b = random_batch(seed=0)
    with pytest.raises(ValueError, match=r"TokenBatch.old_logps has shape"):
        b.replace(old_logps=b.old_logps[:, :-1])
    with pytest.raises(ValueError, match=r"TokenBatch.advantages has shape"):
        b.replace(advantages=b.advantages[:-1])
    with pytest.raises(ValueError, match="TokenBatch.mask must be bool"):
        b.replace(mask=b.mask.long())
    with pytest.raises(ValueError, match="TokenBatch.tokens must be"):
        b.replace(tokens=b.tokens[0])
    with pytest.raises(ValueError, match="TokenBatch.logps must be floating"):
        b.replace(logps=b.tokens)
    with pytest.raises(ValueError, match="W has shape"):
        cancellation(torch.zeros(2, 2), b)


def test_unknown_objective_and_parameters_list_valid_ones():
    with pytest.raises(ValueError, match="valid: grpo, grpo-fix, gspo"):
        objectives.get("ppo")
    with pytest.raises(ValueError, match=r"unknown parameter\(s\) \['clip'\]; valid: \['eps', 'norm'"):
        objectives.get("grpo", clip=0.2)
    with pytest.raises(ValueError, match="norm='mean'"):
        objectives.get("grpo", norm="mean")
    with pytest.raises(ValueError, match="transform='max'"):
        objectives.get("dfpo", transform="max")
    with pytest.raises(ValueError, match="stop_grad=False"):
        objectives.get("dfpo", base="grpo", stop_grad=False)
    with pytest.raises(ValueError, match="ref_logps"):
        objectives.get("grpo", beta=0.1).loss(random_batch(seed=0))
    with pytest.raises(ValueError, match="mechanism"):
        objectives.get("grpo").modulation(random_batch(seed=0), off=("lengths",))


def test_bf16_inputs_are_computed_in_float32():
    b = random_batch(seed=0, dtype=torch.float32)
    bb = b.replace(logps=b.logps.bfloat16(), old_logps=b.old_logps.bfloat16(),
                   advantages=b.advantages.bfloat16())
    for name in ALL:
        obj = objectives.get(name)
        W = obj.modulation(bb)
        assert W.dtype == torch.float32 and torch.isfinite(W).all()
        lp = bb.logps.clone().requires_grad_(True)
        obj.loss(bb.replace(logps=lp)).backward()
        assert lp.grad.dtype == torch.bfloat16
        assert torch.allclose(-lp.grad.float(), W, atol=2e-2 * float(W.abs().max()) + 1e-6)


# ---------------------------------------------------------------- the `gradlab` command line
# Every sub-command, at least five mistakes each: exit code 2 (argparse's, or a ConfigError),
# one line on stderr naming the mistake, nothing raised out of main (no traceback), and no work
# done first (each case returns before a model is loaded). A new sub-command adds a row here.

import json  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

from gradlab.cli.main import COMMANDS, main  # noqa: E402
from gradlab.loop.setup.policy import DEFAULT_POLICY_DIR  # noqa: E402


def _folders(tmp) -> dict:
    corrupt, empty, bare, unknown = (tmp / n for n in ("corrupt", "empty", "bare", "unknown"))
    for d in (corrupt, empty, bare, unknown):
        d.mkdir()
    (corrupt / "config.json").write_text("{not json")
    (empty / "config.json").write_text("{}")
    (empty / "metrics.jsonl").write_text("")
    for f in DEFAULT_POLICY_DIR.iterdir():  # a whole model folder but for its model_type
        shutil.copy(f, unknown / f.name)
    (unknown / "config.json").write_text(json.dumps({"model_type": "no-such-model"}))
    (tmp / "baseline.json").write_text("{oops")
    return {"CORRUPT": str(corrupt), "EMPTY": str(empty), "BARE": str(bare),
            "UNKNOWN": str(unknown), "BADBASE": str(tmp / "baseline.json"),
            "MISSING": str(tmp / "missing.json"), "NODIR": str(tmp / "no" / "dir" / "r.md")}


BAD = {  # sub-command → [(arguments, text the one-line message must contain)]
    "run": [(["ppo"], "ppo"), (["grpo", "--step", "3"], "--step"), (["grpo", "--G", "1"], "--G"),
            (["grpo", "--steps", "x"], "--steps"), (["grpo", "--device", "cuda:7"], "--device"),
            (["grpo", "--device", "tpu"], "--device"), (["grpo", "--device", "cuda:x"], "--device"),
            (["grpo", "--task", "scafold"], "--task"), (["grpo", "--model", "UNKNOWN"], "model_type"),
            (["grpo", "--model", "BARE"], "--model"), (["grpo", "--objectives", "gspo"], "--objectives")],
    "tandem": [(["--objectives", "grpo,ppo"], "ppo"), (["--objectives", "gspo[eps="], "--objectives"),
               (["--objective-params", "{bad"], "--objective-params"), (["--mode", "x"], "--mode"),
               (["--rollout", "x"], "--rollout"), (["--resume", "yes"], "--resume"),
               (["--obj", "grpo"], "--obj"), (["--objective-params", '{"gspo": 3}'], "--objective-params"),
               (["--objective-params", "[1]"], "--objective-params")],
    "reproduce": [(["--lr", "0"], "--lr"), (["--micro-batch", "3"], "--micro-batch"),
                  (["--log", "wandb"], "--log"), (["--on-nonfinite", "ignore"], "--on-nonfinite"),
                  (["--threads", "-1"], "--threads"), (["--roots", "99"], "--roots"),
                  (["--check", "MISSING"], "--check"), (["--check", "BADBASE"], "--check"),
                  (["--save-reference", "NODIR"], "--save-reference")],
    "eval": [(["NODIR"], "no such run"), (["BARE"], "neither a run folder"), ([], "path"),
             (["EMPTY", "--problems", "x"], "--problems"), (["EMPTY", "--samples", "0"], "--samples"),
             (["EMPTY", "--seed", "-1"], "--seed"), (["EMPTY", "--temperature", "0"], "--temperature"),
             (["EMPTY", "--task", "scafold"], "--task"), (["EMPTY", "--prob", "3"], "--prob")],
    "table": [(["--G", "1"], "--G"), (["--G", "x"], "--G"), (["--off-policy", "0"], "--off-policy"),
              (["--seed", "-1"], "--seed"), (["--bogus"], "--bogus"), (["--off", "0.3"], "--off")],
    "view": [(["NODIR"], "does not exist"), (["CORRUPT"], "corrupt"), (["EMPTY"], "no metrics"),
             (["BARE"], "no config.json"), (["EMPTY", "--watch", "-1"], "--watch"), ([], "run")],
    "variance": [(["--task", "scafold"], "--task"), (["--G", "1"], "--G"), (["--K", "1"], "--K"),
                 (["--objectives", "grpo,ppo"], "ppo"), (["--rollout", "x"], "--rollout"),
                 (["--checkpoint", "BARE"], "--checkpoint"), (["--prompts", "0"], "--prompts"),
                 (["--checkpoint", "UNKNOWN"], "model_type")],
    "check": [(["--baseline", "MISSING"], "does not exist"), (["--baseline", "BADBASE"], "not readable"),
              (["--expect", "maybe"], "--expect"), (["--loss", "no_such_module_x:fn"], "no_such_module_x"),
              (["--bogus"], "--bogus"), (["--base", "x"], "--base")],
    "audit": [(["foo"], "verl"), ([], "trainer"), (["--quick"], "trainer"),
              (["trl", "--bogus"], "--bogus"), (["verl", "--bogus"], "--bogus")],
    "doctor": [(["--device", "tpu"], "--device"), (["--device", "cuda:x"], "--device"),
               (["--out", "NODIR"], "--out"), (["--bogus"], "--bogus"), (["--dev", "cpu"], "--dev")],
    "instruments": [(["--bogus"], "--bogus"), (["residual"], "residual"), (["--every", "2"], "--every"),
                    (["-x"], "-x"), (["tax@x"], "tax@x")],
}


def test_bad_input_table_covers_every_subcommand():
    assert set(BAD) == set(COMMANDS)
    assert all(len(cases) >= 5 for cases in BAD.values())


@pytest.mark.parametrize("cmd,args,expect", [(c, a, e) for c, cases in BAD.items() for a, e in cases])
def test_cli_bad_input_is_one_line_naming_the_mistake(cmd, args, expect, tmp_path, capsys):
    names = _folders(tmp_path)
    argv = [cmd] + [names.get(x, x) for x in args]
    try:
        code = main(argv)  # an exception escaping here is the traceback a user would see
    except SystemExit as e:  # argparse
        code = e.code
    err = capsys.readouterr().err.strip()
    assert code == 2, (argv, code, err)
    assert "Traceback" not in err and expect in err, (argv, err)
    assert len([line for line in err.splitlines() if "error" in line]) == 1, err


@pytest.mark.parametrize("argv", [
    ["run", "grpo"], ["tandem", "--max-new-tokens", "8"], ["reproduce"],
    ["run", "grpo", "--task", "scaffold"], ["variance", "--K", "2"],
    ["audit", "trl", "--quick"]])
def test_cli_missing_shipped_policy_is_one_line_naming_the_file(argv, tmp_path, monkeypatch, capsys):
    """An install that lacks a shipped policy's weights: exit 2 and one line naming the file and
    how to restore it, before any work (no run folder); never a fresh warm start in its place."""
    from gradlab.loop.setup import policy, shipped

    def no_warm_start(*a, **kw):
        raise AssertionError("warm start in place of the shipped policy")

    monkeypatch.setattr(policy, "warm_start", no_warm_start)
    for key, (folder, regenerate) in list(shipped.SHIPPED_POLICIES.items()):
        copy = tmp_path / "install" / folder.name
        shutil.copytree(folder, copy)
        (copy / "model.safetensors").unlink()
        monkeypatch.setitem(shipped.SHIPPED_POLICIES, key, (copy, regenerate))
    names = _folders(tmp_path)
    out = tmp_path / "run"
    argv = [names.get(x, x) for x in argv]
    argv += ["--out", str(out)] if argv[0] in ("run", "tandem", "reproduce", "variance", "audit") else []
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, (argv, err)
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "model.safetensors is missing" in err and "git checkout -- gradlab/data/" in err, err
    assert ("scaffold_policy" in err) == ("scaffold" in argv), err  # the task's own policy
    if argv[0] in ("run", "tandem", "reproduce"):
        assert not out.exists()  # refused before the run folder was made


def test_help_version_and_argument_errors_do_not_import_torch():
    code = ("import sys\nfrom gradlab.cli.main import main\n"
            "for argv in (['--help'], ['--version'], ['run', 'grpo', '--step', '3'], "
            "['table', '--G', 'x'], ['check', '--bogus'], ['doctor', '--bogus'], ['audit', 'foo'], "
            "['tandem', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "print(sorted(m for m in ('torch', 'transformers', 'pandas', 'matplotlib') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout[-500:]


def test_cli_copies_of_variance_choices_match_the_module():
    from gradlab.cli.args import ROLLOUTS, VARIANCE_OBJECTIVES
    from gradlab.loop.recipes import variance

    assert ROLLOUTS == variance.ROLLOUTS
    assert VARIANCE_OBJECTIVES == ",".join(variance.DEFAULT_OBJECTIVES)
