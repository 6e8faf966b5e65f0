"""A TRL GRPO run, instrumented by gradlab: swap the trainer class, add one keyword.

The model is gradlab's shipped tiny Qwen3 (a local folder with a character tokenizer, trained to
answer `34+57=?` with `so 34+57=91`); the reward is 1 for the right sum. TRL's own loss is
untouched: gradlab's hook reads W of it; gradlab's instruments measure ρ and the residual on
every optimizer step and write them once per generation batch into TRL's logs (`gradlab/*`
keys, the names of gradlab's own loop) and into a run store,
`<output_dir>/gradlab`, that `gradlab.load_run` reads.

    pip install -e ".[trl]"
    python examples/trl_callback.py                        # 8 prompts × G = 8, 4 generation batches
    python examples/trl_callback.py --prompts 2 --G 8 --gens 1 --out /tmp/trl-example

TRL checkpoints every generation batch: run the same command again and it continues from the
last checkpoint of its --out (a larger --gens trains on; a finished run is read, not retrained).
"""

import argparse
import os
import random
import warnings

from datasets import Dataset
from transformers import TrainerState
from transformers.trainer_utils import get_last_checkpoint
from trl import GRPOConfig

import gradlab
from gradlab.integrations.trl import GradlabConfig, GradlabGRPOTrainer
from gradlab.loop.setup.policy import load_policy
from gradlab.viz.undefined import text_table

warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' renamed-option notices


def arithmetic(n: int, seed: int) -> Dataset:
    rng = random.Random(seed)
    pairs = [(rng.randint(10, 99), rng.randint(10, 99)) for _ in range(n)]
    return Dataset.from_list([{"prompt": f"{a}+{b}=?", "answer": str(a + b)} for a, b in pairs])


def correct_sum(completions: list[str], answer: list[str], **kw) -> list[float]:
    """1.0 when the text after the last '=' is the sum (TRL passes dataset columns as kw)."""
    return [float(c.rsplit("=", 1)[-1].strip() == a) for c, a in zip(completions, answer)]


def main(prompts: int, G: int, gens: int, out: str) -> None:
    model, tokenizer = load_policy()              # gradlab/data/default_policy
    # a re-run in the same --out continues from its last checkpoint (a larger --gens trains on)
    last = get_last_checkpoint(out) if os.path.isdir(out) else None
    done = TrainerState.load_from_json(f"{last}/trainer_state.json").global_step if last else 0
    args = GRPOConfig(
        output_dir=out, use_cpu=True, report_to=[], disable_tqdm=True,
        save_strategy="steps", save_steps=2, save_total_limit=1,  # a checkpoint per batch
        num_generations=G, per_device_train_batch_size=prompts * G // 2,
        steps_per_generation=2, gradient_accumulation_steps=1,   # 2 optimizer steps per batch
        max_steps=2 * gens, logging_steps=2, learning_rate=1e-3, max_completion_length=14)
    trainer = GradlabGRPOTrainer(model=model, processing_class=tokenizer,
                                 reward_funcs=correct_sum, args=args,
                                 train_dataset=arithmetic(64, seed=0),  # dfpo="orth": DFPO on
                                 gradlab=GradlabConfig(resume=last is not None))
    if done < args.max_steps:  # a finished run is only read (transformers would step once more)
        trainer.train(resume_from_checkpoint=last)

    run = gradlab.load_run(f"{out}/gradlab", wide=True)          # one row per generation batch
    cols = ["step", "rho_prefix", "split_share", "shared_frac_prefix", "w_dev"]
    print(text_table(run, cols))  # an undefined ρ (e.g. every group tied) is "—" with its reason


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=8, help="prompts per generation batch")
    p.add_argument("--G", type=int, default=8, help="completions per prompt")
    p.add_argument("--gens", type=int, default=4, help="generation batches to train")
    p.add_argument("--out", default="runs/trl-example", help="TRL output_dir")
    a = p.parse_args()
    main(a.prompts, a.G, a.gens, a.out)
