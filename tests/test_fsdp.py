"""torchrun + FSDP2 (`--fsdp`, gloo, 2 CPU processes) against one process on the same global
batch: same weights, optimizer state and metrics, resume, learning tax and --on-nonfinite skip
included; --fsdp without torchrun is refused.

Tolerances: the sharded run sums gradients in another order (each rank's backward, then a
reduce-scatter) than one process's single backward, so float32 results differ by rounding:
measured ≤ 3e-7 relative on the weights and ≤ 2e-5 on AdamW's moments after 2 steps (ARGS,
`torchrun --nproc_per_node=2 -m gradlab tandem ... --fsdp` against one process). Weights are
held to 1e-5 and moments to 1e-4 relative (of each tensor's max); metrics to rtol 1e-3 with the
absolute floors of tests/test_ddp.py — rounding noise in KL/drift values of ~1e-5 nats is
amplified by their cancellation.
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from procs import run_tree
from safetensors.torch import load_file

import gradlab
from gradlab.loop.config import RunConfig
from gradlab.loop.setup.policy import load_policy
from gradlab.loop.update.batches import minibatches

OBJS = ("gspo", "dfpo-min")
# 8 prompts × G = 4 in 4 optimizer steps of 2 groups, micro-batch 4 = one group per pass:
# a step's two groups are on one rank (the other idles: zero-loss passes) or split 1 + 1
ARGS = ["--objectives", ",".join(OBJS), "--prompts", "8", "--G", "4", "--minibatches", "4",
        "--micro-batch", "4", "--ckpt-every", "1", "--tax-every", "1", "--probe-contexts", "4",
        "--eval-every", "2", "--eval-size", "4", "--no-progress"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def _run(cmd: list[str]) -> None:
    r = run_tree(cmd, timeout=600, together=120, env=ENV)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


@pytest.fixture(scope="module")
def one(tmp_path_factory) -> Path:
    """The reference: one process, 2 rollout steps, no sharding."""
    out = tmp_path_factory.mktemp("one")
    _run([sys.executable, "-m", "gradlab", "tandem", "--out", str(out), "--steps", "2", *ARGS])
    return out


def _same_checkpoints(a_dir: Path, b_dir: Path) -> None:
    for obj in OBJS:
        for f, tol in (("model", 1e-5), ("optimizer", 1e-4)):
            a = load_file(a_dir / "checkpoints" / obj / f"{f}.safetensors")
            b = load_file(b_dir / "checkpoints" / obj / f"{f}.safetensors")
            assert a.keys() == b.keys(), (obj, f, sorted(a.keys() ^ b.keys()))
            for k in a:
                x, y = a[k].double(), b[k].double()
                assert float((x - y).abs().max()) <= tol * (float(x.abs().max()) + 1e-12), (obj, k)


def _same_metrics(a_dir: Path, b_dir: Path) -> None:
    wa, wb = gradlab.load_run(a_dir, wide=True), gradlab.load_run(b_dir, wide=True)
    assert list(wa["step"]) == list(wb["step"]) and len(wa) == 2 * len(OBJS)
    assert (wa["tokens"].to_numpy() == wb["tokens"].to_numpy()).all()
    for m, tol in [("reward", 0), ("accuracy", 0), ("eval_accuracy", 0),
                   ("eval_accuracy_greedy", 0), ("rho_prefix", 1e-6), ("rho_trie", 1e-6),
                   ("probe_kl", 1e-6), ("drift_node_kl_mean", 1e-7),
                   ("drift_node_dlogp_mean", 1e-6), ("grad_norm", 1e-5), ("loss", 1e-6),
                   ("entropy", 1e-6), ("w_max", 1e-6), ("logodds", 1e-5),
                   ("tax_share", 1e-6), ("tax_norm", 1e-9), ("drift_div_pos_dlogp_mean", 1e-6),
                   ("clip_frac", 1e-6), ("ratio_mean", 1e-6), ("attr_residual", 1e-9)]:
        np.testing.assert_allclose(wa[m], wb[m], rtol=1e-3, atol=tol, err_msg=m)
    # attribution shares are ratios to attr_residual: compared where it is not float noise
    real = wa["attr_residual"].to_numpy() > 1e-6
    assert real.any()
    for m in ("attr_clip", "attr_coupling"):
        np.testing.assert_allclose(wa[m][real], wb[m][real], rtol=1e-3, atol=1e-6, err_msg=m)
    assert (wa["rho_prefix"][wa["objective"] == "gspo"] > 1e-3).any()  # a real residual compared


def test_the_layout_has_idle_ranks_and_uneven_passes():
    """ARGS exercise both lock-step paths: a step whose groups all sit on one rank (the other
    runs only zero-loss passes) and a step split across the ranks (prompt g → rank g mod 2)."""
    gen = torch.Generator().manual_seed(0)  # the learners' minibatch generator (seed 0)
    owners = [{g % 2 for g in part.tolist()}
              for _ in range(2) for part in minibatches(torch.arange(8), 4, gen, False, 8)]
    sizes = [len(o) for o in owners]
    assert 1 in sizes and 2 in sizes, owners


def test_two_sharded_ranks_resumed_equal_one_process(one, tmp_path):
    """1 rollout step sharded, then --resume to 2 (the gathered checkpoint, weights and AdamW
    state, is cut back into shards): weights, AdamW state and metrics, the learning tax and the
    ratios the ranks reduce from numerators and denominators (clip_frac, ratio_mean,
    attribution shares) included, as one uninterrupted process."""
    two = tmp_path / "two"
    for steps, extra in (("1", ()), ("2", ("--resume",))):
        _run([*TORCHRUN, "-m", "gradlab", "tandem", "--out", str(two), "--steps", steps, *ARGS,
              "--fsdp", *extra])
    _same_checkpoints(one, two)
    _same_metrics(one, two)


WORKER = r"""
import torch, torch.distributed as dist
from gradlab.loop.scale.dist import setup
from gradlab.loop.scale.fsdp import gathered
from gradlab.loop.setup.policy import load_policy
from gradlab.loop.setup.task import ArithmeticTask
torch.manual_seed(0)
D = setup("cpu", fsdp=True)
model, _ = load_policy(None, task=ArithmeticTask())
ref = {n: p.detach().clone() for n, p in model.named_parameters()}
ids = torch.randint(0, model.config.vocab_size, (2, 7))
want = model(input_ids=ids).logits
model = D.wrap(model)
local = sum(p.to_local().numel() for p in model.parameters())
total = sum(v.numel() for v in ref.values())
assert local <= total // 2 + 64, (local, total)  # 1/2 of every parameter (dim-0 chunks)
with gathered(model):  # rank r runs r + 1 forwards: no collective inside
    for _ in range(D.rank + 1):
        got = model(input_ids=ids).logits
assert torch.equal(got, want), float((got - want).abs().max())
assert all(hasattr(p, "to_local") for p in model.parameters())  # sharded again
out = model(input_ids=ids).logits  # a lock-step forward: all-gathers unit by unit
assert torch.equal(out, want)
print("rank", D.rank, "holds", local, "of", total)
del model  # the sharded model goes before its process group
D.teardown()
"""


def test_sharded_policy_holds_half_and_gathers_for_local_forwards(tmp_path):
    """Each rank stores half of every parameter; inside `gathered` ranks may run different
    numbers of forwards (as sampling and probes do) and get the unsharded model's logits."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    r = run_tree([*TORCHRUN, str(script)], timeout=300, together=120,
                 env={**ENV, "PYTHONPATH": str(Path(gradlab.__file__).parents[1])})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count("holds") == 2, r.stdout


def test_skip_under_fsdp_drops_every_bad_update_on_all_ranks(tmp_path):
    """--lr inf --on-nonfinite skip: each rank sees non-finite values in its own shard only;
    the ranks agree, put every update back and count it (2 optimizer steps per rollout step),
    and the gathered checkpoint holds exactly the initial weights."""
    out = tmp_path / "r"
    _run([*TORCHRUN, "-m", "gradlab", "tandem", "--out", str(out), "--objectives", "gspo",
          "--steps", "1", "--prompts", "4", "--G", "4", "--minibatches", "2", "--tax-every", "0",
          "--probe-contexts", "4", "--eval-every", "0", "--no-progress", "--lr", "inf",
          "--on-nonfinite", "skip", "--fsdp"])
    assert (gradlab.load_run(out, wide=True)["nonfinite_steps"] == 2).all()
    init, _ = load_policy(None)
    saved = load_file(out / "checkpoints" / "gspo" / "model.safetensors")
    for name, w in saved.items():
        torch.testing.assert_close(w, init.state_dict()[name], rtol=0, atol=0)


def test_fsdp_without_torchrun_is_refused_naming_the_launch():
    RunConfig(fsdp=True, on_nonfinite="skip")  # valid options on CPU and CUDA
    r = subprocess.run([sys.executable, "-m", "gradlab", "tandem", "--fsdp", "--out", "unused"],
                       env=ENV, capture_output=True, text=True, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1 and "torchrun" in lines[0], r.stderr
    assert not Path("unused").exists()
