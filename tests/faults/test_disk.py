"""Filesystem faults on a real tiny run: a file-size limit (EFBIG, RLIMIT_FSIZE in the child),
a full disk (ENOSPC, a small tmpfs), a read-only run folder (EROFS, a read-only bind mount),
a run folder under a regular file (ENOTDIR), a crash inside a checkpoint swap and a torn
metrics line. Each: exit code 4 and one line naming the path and the OS error, the last good
checkpoint unchanged, and --resume bitwise equal to the uninterrupted run."""

import json
import logging
import os
import shlex

import pytest

import gradlab
from gradlab.cli.main import main

from .helpers import (
    RUN,
    STEPS,
    assert_same_run,
    can_unshare,
    ckpt_step,
    digest,
    gradlab_cmd,
    in_mount_ns,
    last_line,
    run,
)

NEEDS_NS = pytest.mark.skipif(not can_unshare(), reason="needs a private mount namespace "
                              "(unshare -m: root with CAP_SYS_ADMIN)")


@pytest.fixture
def one_step(tmp_path):
    """A run checkpointed after 1 step (then stopped), and its checkpoint's digest."""
    out = tmp_path / "run"
    assert main(["tandem", "--out", str(out), *RUN, "--steps", "1"]) == 0
    return out, digest(out / "checkpoints")


def _resume(out) -> list[str]:
    return gradlab_cmd(out, "--resume", "--steps", str(STEPS))


def _survived(out, before, reference) -> None:
    """The last good checkpoint is unchanged, nothing temporary is left, and --resume then
    gives the uninterrupted run."""
    assert digest(out / "checkpoints") == before
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["grpo"]
    assert (out / "metrics.jsonl").read_bytes().endswith(b"\n")
    assert main(["tandem", "--out", str(out), "--resume", "--steps", str(STEPS)]) == 0
    assert_same_run(reference, out)


def test_checkpoint_over_the_file_size_limit(one_step, reference):
    """RLIMIT_FSIZE 200 kB: metrics, samples and traces fit, the new checkpoint's
    model.safetensors (324 kB) does not (EFBIG)."""
    out, before = one_step
    rc, err = run(_resume(out), fsize=200_000)
    assert rc == 4, err
    assert last_line(err) == (f"gradlab tandem: error: cannot write {out}/checkpoints/grpo.tmp/"
                              "model.safetensors: File too large [EFBIG]"), err
    assert ckpt_step(out) == 1 and "Traceback" not in err
    # the steps ran (their metrics are kept; --resume drops those after the checkpoint)
    steps = {r["step"] for r in map(json.loads, (out / "metrics.jsonl").open())}
    assert steps == set(range(STEPS))
    _survived(out, before, reference)


def test_metrics_append_over_the_limit_leaves_no_half_line(one_step, reference):
    """The limit sits 100 bytes above metrics.jsonl: the next line (~2 kB) is written in part
    (up to the limit), then cut back: complete lines only, step 0's."""
    out, before = one_step
    metrics = out / "metrics.jsonl"
    size = metrics.stat().st_size
    rc, err = run(_resume(out), fsize=size + 100)
    assert rc == 4, err
    assert last_line(err) == (f"gradlab tandem: error: cannot write {metrics}: File too large "
                              "[EFBIG]"), err
    assert metrics.stat().st_size <= size  # (the resume dropped step 0's end-of-run eval keys)
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()] == [0]
    _survived(out, before, reference)


@NEEDS_NS
def test_full_disk_during_the_checkpoint(one_step, reference, tmp_path):
    """The run folder copied onto a tmpfs with 300 kB free: the new checkpoint (~1 MB, written
    beside the old one) runs out of space (ENOSPC)."""
    out, before = one_step
    disk, after = tmp_path / "disk", tmp_path / "after"
    disk.mkdir()
    after.mkdir()
    used = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    cmd = " ".join(map(shlex.quote, _resume(disk)))
    r = in_mount_ns(f"set -e; mount -t tmpfs -o size={used + 300_000} tmpfs {disk}; "
                    f"cp -a {out}/. {disk}/; set +e; {cmd}; rc=$?; cp -a {disk}/. {after}/; "
                    "exit $rc")
    assert r.returncode == 4, r.stderr
    line = last_line(r.stderr)
    assert line.startswith(f"gradlab tandem: error: cannot write {disk}/checkpoints/grpo.tmp/"), line
    assert line.endswith(".safetensors: No space left on device [ENOSPC]"), line
    assert ckpt_step(after) == 1
    _survived(after, before, reference)


def test_read_only_run_folder(one_step, reference):
    """--resume into a run folder that cannot be written: EROFS through a read-only bind mount
    when the test may mount, else (not root) EACCES through its permissions."""
    out, before = one_step
    cmd = " ".join(map(shlex.quote, _resume(out)))
    if os.geteuid() != 0:
        os.chmod(out, 0o555)
        try:
            rc, err = run(_resume(out))
        finally:
            os.chmod(out, 0o755)
        want = "Permission denied [EACCES]"
    elif can_unshare():
        r = in_mount_ns(f"set -e; mount --bind {out} {out}; mount -o remount,bind,ro {out}; "
                        f"set +e; {cmd}")
        rc, err = r.returncode, r.stderr
        want = "Read-only file system [EROFS]"
    else:
        pytest.skip("root without a private mount namespace: cannot make a folder read-only")
    assert rc == 4, err
    assert last_line(err) == f"gradlab tandem: error: cannot write {out}: {want}", err
    _survived(out, before, reference)


def test_run_folder_under_a_regular_file(tmp_path, capsys):
    """--out below a file (a typo, a mount gone): ENOTDIR, exit 4, nothing written."""
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "run"
    assert main(["tandem", "--out", str(out), *RUN, "--steps", "1"]) == 4
    assert capsys.readouterr().err.strip() == (f"gradlab tandem: error: cannot write {out}: "
                                               "Not a directory [ENOTDIR]")


def test_crash_inside_the_checkpoint_swap(one_step, reference, caplog):
    """Killed between the swap's two renames (the old checkpoint already moved to grpo.old,
    the new one still grpo.tmp, half written): --resume puts the old one back."""
    out, _ = one_step
    ck = out / "checkpoints"
    (ck / "grpo").rename(ck / "grpo.old")
    (ck / "grpo.tmp").mkdir()
    (ck / "grpo.tmp" / "model.safetensors").write_bytes(b"\0" * 100)
    with caplog.at_level(logging.WARNING, "gradlab"):
        assert main(["tandem", "--out", str(out), "--resume", "--steps", str(STEPS)]) == 0
    assert "restoring the previous checkpoint" in caplog.text
    assert sorted(p.name for p in ck.iterdir()) == ["grpo"]
    assert_same_run(reference, out)


def test_torn_metrics_line_is_reported_once_and_repaired_on_resume(one_step, reference, caplog):
    """Power loss mid-append: a reader skips the half line and says so once however often it
    reads; --resume cuts it (reported) and continues to the uninterrupted result."""
    out, _ = one_step
    metrics = out / "metrics.jsonl"
    good = metrics.read_text()
    metrics.write_text(good + '{"step": 1, "objective": "grpo", "lo')
    with caplog.at_level(logging.WARNING, "gradlab"):
        for _ in range(3):
            assert set(gradlab.load_run(out)["step"]) == {0}
        assert caplog.text.count("incomplete last line not read") == 1
        assert main(["tandem", "--out", str(out), "--resume", "--steps", str(STEPS)]) == 0
    assert "torn last line cut" in caplog.text
    assert_same_run(reference, out)


def test_write_error_names_wrapped_os_errors():
    """safetensors and Arrow report OS errors inside their own messages: still named."""
    from gradlab.atomic import WriteError, writing

    with pytest.raises(WriteError, match=r"^cannot write /x/y: File too large \[EFBIG\]$"):
        with writing("/x/y"):
            raise RuntimeError("Error while serializing: I/O error: File too large (os error 27)")
    with pytest.raises(WriteError, match=r"No space left on device \[ENOSPC\]$"):
        with writing("/x/y"):
            raise OSError(28, "Error writing bytes to file. Detail: [errno 28] No space left")
    with pytest.raises(KeyError):  # not an I/O error: untouched
        with writing("/x/y"):
            raise KeyError("k")
