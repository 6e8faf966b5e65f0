"""Where a newcomer goes wrong first: a hand-edited config.json, an option past the model's
context, a model folder missing its tokenizer or weights, a misspelled objective, a bad task
file hidden behind another mistake, a clone that shadows the install. Each gets one line naming
the field, option or folder, exit code 2, and no traceback; the argument checks answer before
torch or transformers load."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import typing
from dataclasses import fields
from pathlib import Path

import pytest

from gradlab.cli.main import main
from gradlab.loop.config import ConfigError, RunConfig, check_types
from gradlab.loop.setup.policy import DEFAULT_POLICY_DIR, SCAFFOLD_POLICY_DIR

REPO = Path(__file__).resolve().parent.parent
RUN = ["--steps", "1", "--prompts", "2", "--G", "2", "--minibatches", "1", "--eval-every", "0"]


def _one_line(argv: list[str], capsys) -> str:
    """main(argv) must return 2 and print exactly one line, no traceback."""
    try:
        code = main(argv)  # an exception escaping here is the traceback a user would see
    except SystemExit as e:  # argparse
        code = e.code
    err = capsys.readouterr().err.strip()
    assert code == 2, (argv, code, err)
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def _model_without(tmp_path: Path, prefixes: tuple[str, ...]) -> Path:
    """The shipped tiny policy without the files whose names start with `prefixes`."""
    folder = tmp_path / ("no-" + prefixes[0].rstrip("._"))
    shutil.copytree(DEFAULT_POLICY_DIR, folder)
    for f in folder.iterdir():
        if f.name.startswith(prefixes):
            f.unlink()
    return folder


def _stored(tmp_path: Path, **edits) -> Path:
    """A run folder whose config.json is a valid run's with `edits` typed in by hand."""
    out = tmp_path / "run"
    out.mkdir()
    data = {**RunConfig(out=str(out)).to_json(), **edits}
    (out / "config.json").write_text(json.dumps(data))
    return out


# ---------------------------------------------------------------- config.json on --resume

@pytest.mark.parametrize("field,value,expected", [
    ("lr", "0.0002", "a number"), ("G", 8.5, "an integer"), ("steps", "40", "an integer"),
    ("prompts", None, "an integer"), ("amp", "yes", "true or false")])
def test_resume_names_a_hand_edited_field_of_the_wrong_type(field, value, expected, tmp_path,
                                                           capsys):
    out = _stored(tmp_path, **{field: value})
    err = _one_line(["tandem", "--out", str(out), "--resume"], capsys)
    assert err == (f"gradlab tandem: error: {out}/config.json: option {field!r} is "
                   f"{json.dumps(value)}" + (f" ({'a string' if isinstance(value, str) else 'a number'})"
                                             if value is not None else "")
                   + f"; expected {expected}; correct the file or start a new run in another --out")


def _wrong(t) -> object:
    """A JSON value that is not of type `t` (a RunConfig annotation)."""
    base = [a for a in typing.get_args(t) if a is not type(None)] or [t]
    t = base[0]
    origin = typing.get_origin(t)
    return {bool: "yes", int: 1.5, float: "1e-4", str: 3}.get(t, "x") if origin is None else (
        ["grpo", 3] if origin is list else {"gspo": 3})


def test_every_field_is_checked_by_its_declared_type():
    hints = typing.get_type_hints(RunConfig)
    good = RunConfig().to_json()
    check_types(good, "config.json")  # a valid run's file passes
    check_types({**good, "lr": 1, "temperature": 2}, "config.json")  # an integer is a number
    for f in fields(RunConfig):
        with pytest.raises(ConfigError, match=rf"^config.json: option '{f.name}' is "):
            check_types({**good, f.name: _wrong(hints[f.name])}, "config.json")
        none_ok = f.default is None  # null only where the default is None
        assert (type(None) in typing.get_args(hints[f.name])) == none_ok, f.name
        if none_ok:
            check_types({**good, f.name: None}, "config.json")
        else:
            with pytest.raises(ConfigError, match=rf"option '{f.name}' is null; expected"):
                check_types({**good, f.name: None}, "config.json")


def test_from_json_checks_types_too(tmp_path):
    out = _stored(tmp_path, micro_batch="16")
    with pytest.raises(ConfigError, match=r"option 'micro_batch' is \"16\" \(a string\); "
                                          r"expected an integer or null"):
        RunConfig.from_json(out / "config.json")


# ---------------------------------------------------------------- options and folders

def test_max_new_tokens_past_the_context_is_named_before_any_work(tmp_path, capsys):
    err = _one_line(["run", "grpo", "--out", str(tmp_path / "r"), "--max-new-tokens", "4096"],
                    capsys)
    assert err.startswith("gradlab run: error: --max-new-tokens: 4096 is invalid; must be < 256, "
                          "the context of the task's policy"), err
    assert not (tmp_path / "r").exists()
    _one_line(["run", "grpo", "--out", str(tmp_path / "r"), "--max-new-tokens", "256"], capsys)
    from gradlab.loop.rollouts.rollout import check_prompt_lengths

    check_prompt_lengths([7], None, 256, 249)  # 7 + 249 = 256 positions: fits
    with pytest.raises(ConfigError, match=r"^prompt 0 has 7 tokens > limit 6 \(max_position_"):
        check_prompt_lengths([7], None, 256, 250)
    with pytest.raises(ConfigError, match=r"^--max-new-tokens: 256 is invalid; must be < 256"):
        check_prompt_lengths([7], None, 256, 256)


@pytest.mark.parametrize("missing,named", [
    (("tokenizer",), "has no tokenizer files (none of tokenizer.json"),
    (("model.safetensors",), "has no weights (none of model.safetensors")])
def test_a_model_folder_without_tokenizer_or_weights_is_named(missing, named, tmp_path, capsys):
    folder = _model_without(tmp_path, missing)
    err = _one_line(["run", "grpo", "--out", str(tmp_path / "r"), "--model", str(folder)], capsys)
    assert err.startswith(f"gradlab run: error: --model: {folder} {named}"), err
    err = _one_line(["eval", str(folder)], capsys)
    assert err.startswith(f"gradlab eval: error: path: {folder} {named}"), err
    from gradlab.loop.setup.policy import load_policy

    with pytest.raises(ConfigError) as e:
        load_policy(folder)
    assert str(e.value).startswith(f"--model: {folder} {named}"), e.value


def test_gradlab_run_names_its_objective_argument(tmp_path, capsys):
    err = _one_line(["run", "grpoo", "--out", str(tmp_path / "r")], capsys)
    assert err.startswith("gradlab run: error: argument objective: unknown objective 'grpoo'; "
                          "valid: grpo,"), err
    err = _one_line(["tandem", "--objectives", "grpo,grpoo", "--out", str(tmp_path / "r")], capsys)
    assert err.startswith("gradlab tandem: error: --objectives: unknown objective 'grpoo'"), err


def test_a_bad_task_file_is_named_before_other_mistakes(tmp_path, capsys):
    task = tmp_path / "t.jsonl"
    task.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n')
    err = _one_line(["run", "grpo", "--task", str(task), "--prompts", "2", "--minibatches", "4",
                     "--out", str(tmp_path / "r")], capsys)
    assert err == f'gradlab run: error: {task}:2: expected an object with "prompt" and "answer"'
    task.write_text('{"prompt": "1+1=", "answer": "2"}\n')  # fixed: the next mistake is named
    err = _one_line(["run", "grpo", "--task", str(task), "--prompts", "2", "--minibatches", "4",
                     "--out", str(tmp_path / "r")], capsys)
    assert "--minibatches: 4 > 2 prompts" in err, err


def test_hints_quote_their_paths(tmp_path):
    from gradlab.loop.runs.resume import reproduce_action

    out = tmp_path / "my run"
    out.mkdir()
    cfg = RunConfig(out=str(out), steps=3)
    (out / "config.json").write_text(json.dumps(cfg.to_json()))
    (out / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError) as e:
        reproduce_action(cfg, resume=False)
    hint = str(e.value).split("`")[1]
    assert shlex.split(hint) == ["gradlab", "reproduce", "--out", str(out), "--resume"], hint


# ---------------------------------------------------------------- answered before torch loads

def test_argument_errors_do_not_import_torch_or_transformers(tmp_path):
    """Every case above, and a value error of each sub-command, in a fresh interpreter: none
    may load torch or transformers (measured: `gradlab tandem --G 0` answers in about 0.5 s)."""
    no_tok = _model_without(tmp_path, ("tokenizer",))
    no_w = _model_without(tmp_path, ("model.safetensors",))
    out = _stored(tmp_path, lr="0.0002")
    (out / "checkpoints" / "grpo").mkdir(parents=True)
    (out / "checkpoints" / "grpo" / "model.safetensors").write_bytes(b"")
    task = tmp_path / "t.jsonl"
    task.write_text('{"prompt": "1+1="}\n')
    cases = [["tandem", "--G", "0"], ["run", "grpoo"], ["run", "grpo", "--max-new-tokens", "4096"],
             ["run", "grpo", "--model", str(no_tok)], ["run", "grpo", "--model", str(no_w)],
             ["run", "grpo", "--task", str(task), "--prompts", "2", "--minibatches", "4"],
             ["tandem", "--out", str(out), "--resume"], ["tandem", "--adv-scale", "x"],
             ["reproduce", "--seeds", "0"], ["reproduce", "--check", str(tmp_path / "no.json")],
             ["eval", str(out), "--objective", "nope"], ["eval", str(no_w)],
             ["variance", "--objectives", "grpo,ppo"], ["doctor", "--device", "tpu"],
             ["table", "--G", "1"], ["view", str(tmp_path / "nothing")],
             ["check", "--baseline", str(tmp_path / "no.json")], ["audit", "verl", "--bogus"],
             ["check", "--loss", "no_such_module_here:fn"], ["check", "--loss", "no_file.py:fn"],
             ["audit", "trl", "--workload", "x"]]
    code = ("import json, sys\nfrom gradlab.cli.main import main\nrcs = []\n"
            f"for argv in {cases!r}:\n"
            "    try:\n        rcs.append(main(argv))\n    except SystemExit as e:\n"
            "        rcs.append(e.code)\n"
            "print(json.dumps([rcs, sorted(m for m in ('torch', 'transformers') if m in sys.modules)]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    rcs, loaded = json.loads(r.stdout.strip().splitlines()[-1])
    errors = r.stderr.strip().splitlines()
    assert rcs == [2] * len(cases) and len(errors) == len(cases), (rcs, errors)
    assert loaded == [], (loaded, errors)


def test_torch_free_copies_equal_their_sources():
    from gradlab.cli.args import model_context
    from gradlab.core import objectives
    from gradlab.core.batch import ADVANTAGE_SCALES
    from gradlab.loop.config import ADV_SCALES, OBJECTIVE_NAMES
    from gradlab.loop.setup.policy import tiny_config

    assert list(OBJECTIVE_NAMES) == objectives.names()
    assert ADV_SCALES == ADVANTAGE_SCALES
    tiny = tiny_config(10).max_position_embeddings  # every warm start's context
    assert model_context(None) == model_context(str(SCAFFOLD_POLICY_DIR)) == tiny == 256


# ---------------------------------------------------------------- a clone beside its parent

def test_a_clone_named_gradlab_does_not_shadow_its_editable_install(tmp_path):
    """`cd ~; python tour.py` with the clone at ~/gradlab: the folder is a namespace package
    candidate in the working directory. pyproject's package-dir puts the project on sys.path
    (a .pth line) at install, so the import system finds the real package there first."""
    clone = tmp_path / "home" / "gradlab"
    clone.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, clone / name)
    (clone / "gradlab").symlink_to(REPO / "gradlab")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip",
                    str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q",
                        "--no-deps", "--no-build-isolation", "--no-index", "-e", str(clone)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    (clone.parent / "tour.py").write_text("import gradlab\nprint(gradlab.TokenBatch.__module__, "
                                          "gradlab.__file__)\n")
    r = subprocess.run([str(py), "tour.py"], cwd=clone.parent, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["gradlab.core.batch", str(clone / "gradlab" / "__init__.py")]
