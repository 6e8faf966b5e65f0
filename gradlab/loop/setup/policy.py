"""Tokenizer, tiny Qwen3 policies, supervised warm start, save/load and evaluation.

The default policy (`load_policy()`) is a tiny Qwen3 warm-started on `ArithmeticTask(2)` until
its temperature-1 accuracy lies in the 20-60 % band, shipped in `gradlab/data/default_policy/`.
Regenerate it with:  python -m gradlab.loop.setup.policy  (calls `make_default_policy`).
"""

from __future__ import annotations

import os
import string
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from ... import jsonio
from ..config import ConfigError, check_model_files
from ..faults.untrusted import check_pickles
from ..numerics.arch import choose_attn, set_dropout
from ..numerics.logprobs import token_logps
from ..rollouts.rollout import encode_pairs, generate
from .shipped import (
    DEFAULT_POLICY_DIR,
    SCAFFOLD_POLICY_DIR,
    SHIPPED_POLICIES,
    check_shipped_policy,
)
from .task import ArithmeticTask, ScaffoldTask

# SCAFFOLD_POLICY_DIR: the shipped warm start of ScaffoldTask(4) (minutes to make on one CPU
# thread: shipped, not cached).
SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")
# Printable ASCII without the exotic whitespace: covers the arithmetic task and most JSONL tasks.
CHARS = "".join(c for c in string.printable if c not in "\t\r\x0b\x0c")
ACCURACY_BAND = (0.2, 0.6)  # warm-start target: accuracy at temperature 1.0


# ----------------------------------------------------------------------------- tokenizer


def build_tokenizer(chars: str = CHARS) -> PreTrainedTokenizerFast:
    """Char-level WordLevel tokenizer: ids 0..2 = <pad>, <eos>, <unk>, then one id per char.

    Left padding (generation appends on the right). Unknown chars map to <unk>.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(list(SPECIAL_TOKENS) + sorted(set(chars)))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(
        Regex("."), behavior="isolated"
    )  # one char = one token
    tok.decoder = decoders.Fuse()  # join chars back without separators
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
    )


# ----------------------------------------------------------------------------- model

_SIZES = {
    # ~0.1M parameters with the default vocab: fast CPU default.
    "tiny": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
    },
    # ~25M parameters: for speed benchmarks.
    "25m": {
        "hidden_size": 512,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "intermediate_size": 1536,
    },
}


def tiny_config(vocab_size: int, size: str = "tiny") -> Qwen3Config:
    """Qwen3 config of a given size ("tiny" or "25m"); eager attention (exact under left padding)."""
    if size not in _SIZES:
        raise ValueError(f"unknown size {size!r}; valid values: {', '.join(_SIZES)}")
    cfg = Qwen3Config(
        vocab_size=vocab_size,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        attention_dropout=0.0,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
        **_SIZES[size],
    )
    cfg._attn_implementation = "eager"
    return cfg


def new_model(tokenizer, size: str = "tiny", seed: int = 0) -> Qwen3ForCausalLM:
    """A freshly initialised Qwen3ForCausalLM; init is seeded without touching the global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen3ForCausalLM(tiny_config(len(tokenizer), size))


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------- warm start


def _sft_batch(task, tokenizer, batch_size: int, step: int, seed: int, g: torch.Generator):
    """A batch of correct solutions; each row picks one of its problem's forms uniformly.

    Problems without solutions (possible in a JSONL task) are skipped, so a batch may be short.
    """
    problems = task.problems(batch_size, seed=1_000_000 * (seed + 1) + step)
    problems = [p for p in problems if task.solutions(p)] or [_first_with_solution(task)]
    responses = []
    for p in problems:
        sols = task.solutions(p)
        responses.append(sols[int(torch.randint(len(sols), (1,), generator=g))])
    return encode_pairs(tokenizer, [p.prompt for p in problems], responses)


def _first_with_solution(task):
    """A problem of `task` with at least one correct solution; ValueError if there is none."""
    for p in task.problems(256, seed=0):
        if task.solutions(p):
            return p
    raise ValueError(
        f"warm start needs correct solutions, but task {task.key} has none "
        '(add "solutions": [...] to the JSONL lines)'
    )


def warm_start(
    task=None,
    seed: int = 0,
    *,
    steps: int | None = None,
    progress: bool = True,
    size: str = "tiny",
    batch_size: int = 64,
    lr: float = 3e-3,
    check_every: int = 20,
    max_steps: int = 3000,
    target: float = 0.35,
) -> tuple[Qwen3ForCausalLM, PreTrainedTokenizerFast, dict]:
    """Supervised warm start of a fresh tiny Qwen3 on the task's correct solutions (both forms).

    Cross-entropy on response tokens (incl. EOS), AdamW, batches of `batch_size` problems with
    a uniformly random solution form per row, so the policy samples both forms.
    steps=None: every `check_every` steps, measure accuracy at temperature 1.0 (128 samples) and
        stop at the first check with accuracy >= `target` (0.35 sits inside the 20-60 %
        ACCURACY_BAND with room for the estimate's noise and its upward selection bias);
        give up after `max_steps`.
    steps=int: train exactly that many steps (no checks).
    Deterministic given `seed` (CPU, fixed thread count). Returns (model, tokenizer, info) with
    info = {steps, accuracy (fresh 256-sample estimate), in_band, seconds, ...}.
    """
    task = task if task is not None else ArithmeticTask()
    _first_with_solution(task)  # fail early with a clear error
    t0 = time.time()
    tokenizer = build_tokenizer()
    model = new_model(tokenizer, size=size, seed=seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    total = steps if steps is not None else max_steps
    bar = tqdm(range(1, total + 1), desc="warm start", disable=not progress, leave=False)
    acc, step = float("nan"), 0
    for step in bar:
        pi, pm, ri, rm = _sft_batch(task, tokenizer, batch_size, step, seed, g)
        logps = token_logps(model, pi, pm, ri, rm)  # (B, T)
        loss = -logps.sum() / rm.sum()  # mean NLL per response token (nats)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if steps is None and step % check_every == 0:
            acc = evaluate(model, tokenizer, task, n=128, seed=seed + 1)["accuracy"]
            bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{acc:.2f}")
            if acc >= target:
                break
    bar.close()
    model.eval()
    final = evaluate(model, tokenizer, task, n=256, seed=seed + 2)
    info = {
        "task": task.key,
        "seed": seed,
        "size": size,
        "steps": step,
        "check_accuracy": acc,
        "accuracy": final["accuracy"],
        "form0_share": final["form0_share"],
        "form1_share": final["form1_share"],
        "in_band": ACCURACY_BAND[0] <= final["accuracy"] <= ACCURACY_BAND[1],
        "seconds": round(time.time() - t0, 2),
    }
    return model, tokenizer, info


# ----------------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate(model, tokenizer, task, n: int = 128, temperature: float = 1.0, seed: int = 0) -> dict:
    """Sample one response for each of `n` problems (task.problems(n, seed)) and score them.

    Returns accuracy (fraction correct), mean_reward, form0_share / form1_share (fraction of all
    samples that are exactly solution form 0 / 1), mean_length (response tokens incl. EOS), n.
    """
    problems = task.problems(n, seed=seed)
    g = torch.Generator().manual_seed(seed)
    ro = generate(
        model,
        tokenizer,
        problems,
        G=1,
        max_new_tokens=task.max_new_tokens,
        temperature=temperature,
        generator=g,
        task=task,
    )
    forms = [task.solution_form(p, t) for p, t in zip(ro.problems, ro.texts)]
    correct = [task.is_correct(p, t) for p, t in zip(ro.problems, ro.texts)]
    return {
        "accuracy": sum(correct) / n,
        "mean_reward": float(ro.rewards.mean()),
        "form0_share": forms.count(0) / n,
        "form1_share": forms.count(1) / n,
        "mean_length": float(ro.lengths.float().mean()),
        "n": n,
    }


# ----------------------------------------------------------------------------- save / load


def save_policy(model, tokenizer, path: str | Path, info: dict | None = None) -> Path:
    """Save model (safetensors) + tokenizer to folder `path`; `info` goes to gradlab_info.json."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)  # transformers 5 writes model.safetensors
    tokenizer.save_pretrained(path)
    if info is not None:
        (path / "gradlab_info.json").write_text(jsonio.dumps(info, indent=2) + "\n")
    return path


def _load_folder(path: Path, device, attn: str = "auto", trust_remote_code: bool = False,
                 dropout: bool = False) -> tuple:
    """(model, tokenizer) from a folder. float32 master weights whatever the stored dtype (a
    bf16 folder trained in bf16 loses small AdamW updates to rounding; `--amp` autocasts the
    forward to bf16 instead, loop/numerics/precision.py); attention per `choose_attn` (the toy policies
    use eager); dropout off unless `dropout` (`set_dropout`)."""
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    attn = choose_attn(config, attn)
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a "Loading weights" bar per tiny load is noise
    try:
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn,
                                                     dtype=torch.float32,
                                                     trust_remote_code=trust_remote_code)
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    set_dropout(model, keep=dropout)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:  # many HF LMs ship without one: pad with EOS (masked out)
        if tokenizer.eos_token is None:
            raise ConfigError(f"--model: the tokenizer in {path} has neither a pad nor an EOS "
                              "token; gradlab ends every response with EOS (add one with "
                              "tokenizer.add_special_tokens, then save_pretrained)")
        tokenizer.pad_token = tokenizer.eos_token
    return model.to(device).eval(), tokenizer


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """cache_dir, else $GRADLAB_CACHE, else ~/.cache/gradlab."""
    if cache_dir is not None:
        return Path(cache_dir)
    return Path(os.environ.get("GRADLAB_CACHE", Path.home() / ".cache" / "gradlab"))


def load_policy(
    path: str | Path | None = None, task=None, *, cache_dir: str | Path | None = None, device="cpu",
    trust_remote_code: bool = False, attn: str = "auto", dropout: bool = False,
) -> tuple:
    """Load (model, tokenizer).

    path: a local Hugging Face causal-LM folder (model + its tokenizer); FileNotFoundError if
        missing, ConfigError naming what it lacks (weights, tokenizer files:
        `check_model_files`). path=None: the warm-started tiny policy for `task` (default
        ArithmeticTask(2)): the shipped gradlab/data/default_policy (ArithmeticTask(2)) or
        scaffold_policy (ScaffoldTask(4)), `MissingPolicyError` (a FileNotFoundError naming
        the file and how to restore it) when the install lacks one of its files; any other
        task's is warm-started on first use (seed 0) and cached under
        `cache_root(cache_dir)/<task.key>-seed0`.
    The model is returned in eval mode on `device`, dropout off unless `dropout`
    (`set_dropout`), attention per `attn` (`choose_attn`; the tiny policies use eager unless
    forced). A folder that asks for remote code
    (auto_map) is refused unless trust_remote_code; pickle weights are read with
    weights_only=True only (loop/faults/untrusted.py).
    """
    if path is not None:
        path = Path(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"no Hugging Face model folder (config.json) at {path}")
        check_model_files(path, trust_remote_code)  # weights and tokenizer present, or named
        check_pickles(path)
        return _load_folder(path, device, attn, trust_remote_code, dropout)
    attn = "eager" if attn == "auto" else attn  # the toy policies: exact under left padding
    key = task.key if task is not None else ArithmeticTask().key
    if key in SHIPPED_POLICIES:  # never a fresh warm start in place of a shipped policy
        check_shipped_policy(key)
        return _load_folder(SHIPPED_POLICIES[key][0], device, attn, dropout=dropout)
    folder = cache_root(cache_dir) / f"{key}-seed0"
    if not (folder / "config.json").is_file():
        model, tokenizer, info = warm_start(task if task is not None else ArithmeticTask())
        save_policy(model, tokenizer, folder, info)
    return _load_folder(folder, device, attn, dropout=dropout)


def make_default_policy(out_dir: str | Path = DEFAULT_POLICY_DIR) -> dict:
    """Regenerate the shipped default policy: warm_start(ArithmeticTask(2), seed=0) -> out_dir."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the shipped checkpoint was made with 2 CPU threads
    try:
        model, tokenizer, info = warm_start(ArithmeticTask(difficulty=2), seed=0)
    finally:
        torch.set_num_threads(threads)
    save_policy(model, tokenizer, out_dir, info)
    return info


def make_scaffold_policy(out_dir: str | Path = SCAFFOLD_POLICY_DIR) -> dict:
    """Regenerate the shipped scaffold policy: warm_start on ScaffoldTask(4)'s training split
    (held-out problems never seen, loop/setup/heldout.py), seed 0, 1 CPU thread -> out_dir
    (python -c "from gradlab.loop.setup.policy import make_scaffold_policy as m; print(m())")."""
    from .heldout import TrainSplit

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, tokenizer, info = warm_start(TrainSplit(ScaffoldTask()), seed=0, progress=False)
    finally:
        torch.set_num_threads(threads)
    save_policy(model, tokenizer, out_dir, info)
    return info


if __name__ == "__main__":
    print(make_default_policy())
