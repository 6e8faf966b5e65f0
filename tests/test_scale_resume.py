"""--resume with the real-model options (max_prompt_len, chat_template, grad_checkpointing,
verifier): they are stored in config.json, reused by `--resume` alone, compared like every other
option when typed again, and absent from an older config.json they are not compared."""

from __future__ import annotations

import json
from dataclasses import asdict

from gradlab.cli.main import main
from gradlab.loop.config import RunConfig
from gradlab.loop.runs.resume import config_differences

NEW = ("max_prompt_len", "chat_template", "grad_checkpointing", "verifier")
RUN = ["--objectives", "grpo", "--prompts", "2", "--G", "2", "--minibatches", "1",
       "--probe-contexts", "2", "--tax-every", "0", "--no-progress", "--max-new-tokens", "6",
       "--max-prompt-len", "40", "--grad-checkpointing", "--no-chat-template",
       "--verifier", "exact"]


def _one_line(capsys) -> str:
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1, err
    return err[0]


def test_config_differences_name_the_new_options_and_skip_them_when_absent():
    stored = asdict(RunConfig(max_prompt_len=40, grad_checkpointing=True))
    given = asdict(RunConfig(max_prompt_len=50, chat_template=True, grad_checkpointing=True,
                             verifier="math"))
    assert config_differences(stored, given) == [
        "--chat-template: stored False, given True",
        "--max-prompt-len: stored 40, given 50",
        "--verifier: stored 'exact', given 'math'",
    ]
    older = {k: v for k, v in stored.items() if k not in NEW}  # a config.json from before them
    assert config_differences(older, given) == []


def test_resume_keeps_the_stored_options_and_refuses_changed_ones(tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["tandem", "--out", str(out), *RUN, "--steps", "1"]) == 0
    stored = json.loads((out / "config.json").read_text())
    assert {k: stored[k] for k in NEW} == {"max_prompt_len": 40, "chat_template": False,
                                           "grad_checkpointing": True, "verifier": "exact"}
    capsys.readouterr()
    rc = main(["tandem", "--out", str(out), "--resume", "--chat-template", "--max-prompt-len",
               "50", "--no-grad-checkpointing"])
    assert rc == 2
    err = _one_line(capsys)
    for part in ("--chat-template: stored False, given True",
                 "--max-prompt-len: stored 40, given 50",
                 "--grad-checkpointing: stored True, given False"):
        assert part in err, err
    # typed again with the stored values (the --no- form included): accepted, run extended
    assert main(["tandem", "--out", str(out), "--resume", "--steps", "2", "--no-chat-template",
                 "--max-prompt-len", "40"]) == 0
    stored = json.loads((out / "config.json").read_text())
    assert stored["steps"] == 2 and stored["max_prompt_len"] == 40
    assert stored["grad_checkpointing"] is True
    steps = {json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()}
    assert steps == {0, 1}
