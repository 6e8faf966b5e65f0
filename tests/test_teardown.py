"""Distributed runs end on every rank: the teardown order (barrier, DDP / FSDP wrappers released
and collected, process group destroyed) on success, on an error and on a signal, and the
process checks every multi-process test relies on (tests/procs.py, tests/conftest.py).

test_two_rank_jobs_end_on_every_rank takes 50-90 s on 2 busy CPU cores: one torchrun launch of
two ranks, each calling `gradlab.train` 6 times (tests/teardown_child.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from procs import alive, kill, leftover_children, run_tree

CHILD = str(Path(__file__).with_name("teardown_child.py"))
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
ROUNDS = 6  # 2 × (DDP, FSDP), then an error round (DDP) and a SIGTERM round (FSDP)
linux = pytest.mark.skipif(not Path("/proc").exists(), reason="follows processes through /proc")


@linux
def test_two_rank_jobs_end_on_every_rank(tmp_path):
    """Each round joins a process group, wraps the policy, trains, leaves: at every destroy no
    wrapper is alive (not even as uncollected garbage), every round ends as it should on both
    ranks, and no process of the job is running once the launcher has ended; a rank still
    running 60 s after the other ended fails at once (the tree is killed)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           CHILD, str(tmp_path), str(ROUNDS)]
    r = run_tree(cmd, timeout=300, grace=10, together=60, env=ENV)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for rank in (0, 1):
        rec = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert rec["rounds"] == ["ok"] * (ROUNDS - 2) + ["error", "preempted"], (rank, rec)
        assert rec["alive"] == [0] * ROUNDS, (
            f"rank {rank}: DDP/FSDP wrappers alive when each process group was destroyed: "
            f"{rec['alive']}")
    for i in range(ROUNDS - 2):  # rank 0 wrote every finished round's checkpoint
        assert (tmp_path / f"round{i}" / "checkpoints" / "grpo" / "model.safetensors").exists()
    assert (tmp_path / f"round{ROUNDS - 1}" / "checkpoints" / "term" / "state.json").exists()


@linux
def test_run_tree_fails_on_a_process_left_behind():
    with pytest.raises(AssertionError, match="still running 1 s after the launcher ended") as e:
        run_tree(["sh", "-c", "sleep 60 & sleep 1"], timeout=60, grace=1)
    assert "sleep 60" in str(e.value)


@linux
def test_run_tree_fails_when_one_rank_outlives_the_other():
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match="1 rank.s. still running 2 s after another ended"):
        run_tree(["sh", "-c", "sleep 60 & sleep 3 & wait"], timeout=60, together=2)
    assert time.monotonic() - t0 < 30


@linux
def test_run_tree_kills_the_whole_tree_on_timeout():
    """A worker in a session of its own (as torchrun starts them) is killed with its launcher."""
    script = ("import subprocess, time; "
              "w = subprocess.Popen(['sleep', '60'], start_new_session=True); "
              "print('worker', w.pid, flush=True); time.sleep(60)")
    with pytest.raises(AssertionError, match="still running after 10 s") as e:
        run_tree([sys.executable, "-c", script], timeout=10)  # room for a slow start
    pid = int(str(e.value).split("worker ")[1].split()[0])
    time.sleep(0.5)
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1][:3]


@linux
def test_session_check_finds_a_re_parented_orphan():
    """A process whose parent has ended is re-parented to pytest (the subreaper of what its
    tests start, tests/conftest.py), so the session's end finds it."""
    subprocess.run(["sh", "-c", "sleep 60 >/dev/null 2>&1 &"], check=True, timeout=30)
    left = leftover_children(grace=0.5)
    try:
        assert any(cmd.startswith("sleep 60") for cmd in left.values()), left
    finally:
        kill(set(left))
    time.sleep(0.2)
    assert not any(alive(k) for k in left)


@pytest.fixture
def one_rank_group(monkeypatch):
    """A real one-rank gloo group, and a `Dist` that acts as a rank of a job on it; records
    whether each tracked wrapper is alive when the group is destroyed. The automatic garbage
    collector is off meanwhile: only teardown's own collection frees a wrapper's cycle."""
    import gc
    import weakref

    import torch.distributed as dist

    from gradlab.loop.scale.dist import Dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    refs, at_destroy = [], []
    destroy = dist.destroy_process_group

    def observed(*a, **k):
        at_destroy.append([r() is not None for r in refs])
        return destroy(*a, **k)

    monkeypatch.setattr(dist, "destroy_process_group", observed)
    D = Dist(rank=0, world=2)  # teardown acts as on a rank (world > 1)
    gc.disable()
    try:
        yield D, lambda m: refs.append(weakref.ref(m)) or m, at_destroy
    finally:
        gc.enable()
        if dist.is_initialized():
            destroy()


def _trained(D, track, fail: bool):
    import torch

    m = track(D.wrap(torch.nn.Linear(2, 2)))
    opt = torch.optim.AdamW(m.parameters())
    m(torch.ones(3, 2)).sum().backward()
    opt.step()
    if fail:
        raise RuntimeError("the step failed")
    return float(next(m.parameters()).detach().sum())


def test_teardown_releases_wrappers_before_destroying_the_group(one_rank_group):
    import torch.distributed as dist

    D, track, at_destroy = one_rank_group
    with D:
        _trained(D, track, fail=False)
    assert at_destroy == [[False]] and not dist.is_initialized()


def test_teardown_after_an_error_clears_the_failed_frames(one_rank_group):
    """The traceback keeps the failed frame, and its wrapper, alive: teardown clears it."""
    import torch.distributed as dist

    D, track, at_destroy = one_rank_group
    with pytest.raises(RuntimeError, match="the step failed"):
        with D:
            _trained(D, track, fail=True)
    assert at_destroy == [[False]] and not dist.is_initialized()


def test_teardown_warns_of_a_wrapper_the_caller_still_holds(one_rank_group, caplog):
    import torch

    D, track, at_destroy = one_rank_group
    with D:
        kept = track(D.wrap(torch.nn.Linear(2, 2)))
    assert at_destroy == [[True]]
    assert "1 data-parallel wrapper(s) still referenced" in caplog.text
    del kept
