"""Untrusted inputs (loop/faults/untrusted.py): a model folder asking for remote code, pickle
weights, an oversized JSONL task. Refused with one line and exit code 2 before anything runs
or is read; the code in them never runs unless trusted."""

import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch

from gradlab.cli.main import main
from gradlab.loop.setup.policy import DEFAULT_POLICY_DIR

from .helpers import ENV, RUN

EVIL = """
import pathlib
pathlib.Path({marker!r}).write_text("ran")
from transformers import Qwen3ForCausalLM
class Shipped(Qwen3ForCausalLM):
    pass
"""


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.fixture
def remote_code_model(tmp_path):
    """The shipped tiny policy whose config asks for a class from shipped.py, which leaves a
    marker file when it is imported."""
    folder = tmp_path / "model"
    shutil.copytree(DEFAULT_POLICY_DIR, folder)
    marker = tmp_path / "code-ran"
    (folder / "shipped.py").write_text(EVIL.format(marker=str(marker)))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "shipped.Shipped"}
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder, marker


def test_remote_code_is_refused_without_trust(tmp_path, remote_code_model, capsys):
    folder, marker = remote_code_model
    out = tmp_path / "run"
    assert main(["tandem", "--out", str(out), "--model", str(folder), *RUN, "--steps", "1"]) == 2
    assert _one_line(capsys) == (
        f"gradlab tandem: error: --model: {folder}/config.json asks to run code shipped with the "
        "model (auto_map: shipped.Shipped); refused: pass --trust-remote-code if you trust this "
        "folder's code")
    assert not marker.exists() and not out.exists()


def test_remote_code_runs_with_trust_remote_code(tmp_path, remote_code_model):
    """The flag is honoured: the folder's class is imported (its marker appears) and trains.
    A subprocess: transformers copies the code into HF_MODULES_CACHE (here a temp folder)."""
    folder, marker = remote_code_model
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "gradlab", "tandem", "--out", str(out), "--model",
                        str(folder), "--trust-remote-code", *RUN, "--steps", "1"],
                       env={**ENV, "HF_MODULES_CACHE": str(tmp_path / "modules")},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert marker.read_text() == "ran"
    assert json.loads((out / "config.json").read_text())["trust_remote_code"] is True


def _pickle_model(tmp_path, payload=None):
    """The shipped policy with its weights as pytorch_model.bin (a pickle) only."""
    folder = tmp_path / "pickled"
    shutil.copytree(DEFAULT_POLICY_DIR, folder)
    from safetensors.torch import load_file

    sd = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    if payload is None:
        torch.save(sd, folder / "pytorch_model.bin")
    else:
        with open(folder / "pytorch_model.bin", "wb") as f:
            pickle.dump(payload, f, protocol=2)
    return folder


class _RunsCode:
    """A pickle that calls os.system when it is loaded without weights_only."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_holding_code_is_refused_and_never_runs(tmp_path, capsys):
    marker = tmp_path / "code-ran"
    folder = _pickle_model(tmp_path, {"model.embed_tokens.weight": _RunsCode(marker)})
    assert main(["tandem", "--out", str(tmp_path / "run"), "--model", str(folder), *RUN,
                 "--steps", "1"]) == 2
    err = _one_line(capsys)
    assert err.startswith(f"gradlab tandem: error: --model: {folder}/pytorch_model.bin is a "
                          "pickle that torch.load(weights_only=True) refuses ("), err
    assert err.endswith("gradlab never unpickles code: convert it to safetensors with the tool "
                        "that made it"), err
    assert not marker.exists()


def test_a_pickle_of_tensors_is_read_with_weights_only(tmp_path):
    """The same weights as a tensors-only pickle: accepted, and the run equals the run from
    the safetensors folder (the weights were read whole)."""
    from .helpers import assert_same_run

    folder = _pickle_model(tmp_path)
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["tandem", "--out", str(a), "--model", str(folder), *RUN, "--steps", "1"]) == 0
    assert main(["tandem", "--out", str(b), "--model", str(DEFAULT_POLICY_DIR), *RUN,
                 "--steps", "1"]) == 0
    assert_same_run(a, b)


def test_a_jsonl_task_over_the_size_limit_is_refused_unread(tmp_path, capsys, monkeypatch):
    """A 257 MiB sparse file (zeros: reading it would fail on its content, not its size) is
    refused from its size alone; GRADLAB_MAX_TASK_MB moves the limit."""
    big = tmp_path / "big.jsonl"
    with open(big, "wb") as f:
        f.truncate(257 * 2**20)
    assert main(["tandem", "--out", str(tmp_path / "run"), "--task", str(big), *RUN]) == 2
    assert _one_line(capsys) == (
        f"gradlab tandem: error: --task: {big} is 257 MiB, over the 256 MiB limit for a JSONL "
        "task (read into memory whole); split it, or raise the limit with GRADLAB_MAX_TASK_MB")
    assert not (tmp_path / "run").exists()  # refused before the run folder was made
    small = tmp_path / "small.jsonl"
    small.write_text('{"prompt": "1+1=?", "answer": "2"}\n' * 40_000)  # 1.4 MB
    monkeypatch.setenv("GRADLAB_MAX_TASK_MB", "1")
    assert main(["tandem", "--out", str(tmp_path / "run"), "--task", str(small), *RUN]) == 2
    assert "over the 1 MiB limit" in _one_line(capsys)
    for bad in ("lots", "0", "-5", "nan"):  # a bad limit is named, never read as no limit
        monkeypatch.setenv("GRADLAB_MAX_TASK_MB", bad)
        assert main(["tandem", "--out", str(tmp_path / "run"), "--task", str(small), *RUN]) == 2
        assert _one_line(capsys) == (
            f"gradlab tandem: error: GRADLAB_MAX_TASK_MB={bad!r}: not a size; valid: a number "
            "of MiB > 0 (or unset it for the default)")
    from gradlab.loop.setup.task import JsonlTask

    monkeypatch.delenv("GRADLAB_MAX_TASK_MB")
    assert len(JsonlTask(small)) == 40_000  # under the default limit: read
