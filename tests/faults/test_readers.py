"""Readers during writes: `load_run`, `load_traces` and `gradlab view` on a run being written
return a consistent prefix and never raise; `gradlab view --watch` follows the run."""

import json
import logging
import signal
import time

import gradlab
from gradlab.cli.main import main
from gradlab.viz.html import watch

from .helpers import RUN, STEPS, gradlab_cmd, popen, wait_lines


def _prefix(out) -> int:
    """Read the run as a notebook would; check the prefix is consistent; its length."""
    # the traces first: read after the metrics, they could hold steps the run wrote in between
    traced = set(gradlab.load_traces(out)["step"])
    wide = gradlab.load_run(out, wide=True)
    steps = list(wide["step"])
    assert steps == list(range(len(steps)))  # whole steps, in order, none missing
    assert wide.drop(columns=["eval_accuracy", "eval_accuracy_greedy"], errors="ignore") \
        .filter(like="time_step").notna().all().all()
    assert traced <= set(range(0, len(steps) + 1, 2))  # trace file of a step precede its line
    return len(steps)


def test_reading_a_run_while_it_trains(tmp_path):
    """A real run (trace every 2 steps) read in a loop as fast as possible while it writes:
    every read is a prefix and the prefixes grow; the page is written from a live run too."""
    out = tmp_path / "run"
    # far more steps than the reads take: the run is stopped by the SIGTERM below, not by its end
    p = popen(gradlab_cmd(out, *RUN, "--steps", "5000", "--ckpt-every", "1"))
    try:
        wait_lines(out / "metrics.jsonl", 1, p)
        seen, t0 = [], time.time()
        while time.time() - t0 < 4 and p.poll() is None:
            seen.append(_prefix(out))
        assert main(["view", str(out), "--out", str(tmp_path / "page.html")]) == 0
        assert p.poll() is None  # (the reads above overlapped the writes)
        assert len(seen) >= 3 and seen == sorted(seen) and seen[-1] > seen[0], seen
    finally:
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=120)
    assert p.returncode == 143


def test_a_half_written_line_and_parquet_file_are_not_read(tmp_path, caplog):
    """The exact states a reader can meet mid-write: a metrics line without its end, a trace
    file still under its temporary name (half written). Both are left out, nothing raises."""
    out = tmp_path / "run"
    assert main(["tandem", "--out", str(out), *RUN, "--steps", "3"]) == 0
    whole = gradlab.load_run(out)
    metrics = out / "metrics.jsonl"
    text = metrics.read_text()
    last = text.splitlines()[-1]
    metrics.write_text(text + last[: len(last) // 2])  # step 3 being appended
    raw = (out / "traces" / "grpo" / "step000002.parquet").read_bytes()
    (out / "traces" / "grpo" / "step000004.parquet.tmp").write_bytes(raw[: len(raw) // 2])
    with caplog.at_level(logging.WARNING, "gradlab"):
        assert gradlab.load_run(out).equals(whole)
        assert set(gradlab.load_traces(out)["step"]) == {0, 2}
        assert main(["view", str(out)]) == 0
    page = (out / "view.html").read_text()
    assert "step000004" not in page and '"refresh"' not in page


def test_view_watch_follows_until_every_step_is_checkpointed(tmp_path, reference):
    """A stopped run (checkpointed 1 of 4 steps): each page reloads itself; the finished run
    gets one page without the reload and `--watch` returns."""
    out = tmp_path / "run"
    assert main(["tandem", "--out", str(out), *RUN, "--steps", "1"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "steps": STEPS}))  # 1 of 4 done
    said = []  # (what watch said, the page at that moment)
    page = watch(out, every=0.01, rounds=2,
                 say=lambda m: said.append((m, (out / "view.html").read_text())))
    assert said[0][0].endswith("(1 of 4 steps checkpointed); again in 0.01 s (Ctrl-C stops)")
    assert '<meta http-equiv="refresh" content="0.01">' in said[0][1]  # reloads itself
    assert len(said) == 2 and '"refresh"' not in page.read_text()  # the last page: no reload
    assert main(["view", str(reference), "--watch", "0.01"]) == 0  # finished: one page, returns
    assert '"refresh"' not in (reference / "view.html").read_text()
