"""GradlabGRPOTrainer on two torchrun processes (gloo, CPU) against one process on the same
global batch and identical completions (tests/trl_child.py makes sampling and the loss-call
split independent of the process layout): W, every metric in the store and in TRL's logs, the
token counts and the update equal one process's, also after a resume on two processes."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")

from procs import run_tree  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

import gradlab  # noqa: E402

CHILD = str(Path(__file__).with_name("trl_child.py"))
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
CASES = ("dapo", "grpo_accum", "dapo_offpolicy", "dfpo", "ibpo", "ibpo_split")
RTOL = 1e-4  # as tests/test_ddp.py: float rounding of the gradient all-reduce and padding


def _launch(out: Path, procs: int, *extra: str) -> None:
    head = ([sys.executable] if procs == 1 else
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             f"--nproc_per_node={procs}"])
    r = run_tree([*head, CHILD, str(out), *extra], timeout=600, together=120, env=ENV)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("trl_mp")
    _launch(root / "one", 1)
    _launch(root / "two", 2)
    return root / "one", root / "two"


def rel_diff(a: np.ndarray, b: np.ndarray) -> float:
    """max |a − b| / max |a| (0 for two zero arrays)."""
    scale = float(np.abs(a).max()) if a.size else 0.0
    return float(np.abs(a - b).max()) / scale if scale > 0 else float(np.abs(b).max(initial=0))


def same_windows(wa: dict, wb: dict, only: set | None = None) -> dict[str, float]:
    """Per-token W (and W_base) of every window, at the tokens TRL's loss counts; returns the max
    relative differences."""
    keys = sorted(k for k in wa if only is None or k.split("/")[0] in only)
    assert keys and set(keys) <= set(wb)
    out = {}
    for k in keys:
        a, b = wa[k].numpy(), wb[k].numpy()
        assert a.shape == b.shape, k
        if k.endswith(("/mask", "/tokens")):
            assert (a == b).all(), f"{k}: the runs did not train on identical completions"
            continue
        m = wa[k.rsplit("/", 1)[0] + "/mask"].numpy().astype(bool)
        assert np.abs(a[m]).max() > 0, k
        np.testing.assert_allclose(b[m], a[m], rtol=RTOL, atol=RTOL * np.abs(a[m]).max(),
                                   err_msg=k)
        out[k] = rel_diff(a[m], b[m])
    return out


def same_store(sa, sb) -> dict[str, float]:
    """Every metric of the run store within RTOL; counts and steps exactly."""
    assert sorted(sa.columns) == sorted(sb.columns) and len(sa) == len(sb) > 0
    for c in ("step", "tokens", "global_step", "iteration", "objective"):
        assert list(sa[c]) == list(sb[c]), c
    out = {}
    for c in sa.columns:
        if sa[c].dtype.kind == "f" and c not in ("seed",):
            a, b = sa[c].to_numpy(), sb[c].to_numpy()
            np.testing.assert_allclose(b, a, rtol=RTOL, atol=1e-6, err_msg=c)
            out[c] = rel_diff(a, b)
    return out


def initial_weights() -> dict:
    from gradlab.loop.setup.policy import load_policy

    return {k: v.detach().clone() for k, v in load_policy()[0].state_dict().items()}


def gradlab_logs(path: Path) -> list[dict]:
    return [{k: v for k, v in h.items() if k.startswith("gradlab/")}
            for h in json.loads(path.read_text()) if any(k.startswith("gradlab/") for k in h)]


@pytest.mark.parametrize("case", CASES)
def test_two_processes_equal_one(runs, case):
    one, two = (r / case for r in runs)
    wa, wb = load_file(one / "windows.safetensors"), load_file(two / "windows.safetensors")
    same_windows(wa, wb)
    sa = gradlab.load_run(one / "store", wide=True)
    sb = gradlab.load_run(two / "store", wide=True)
    same_store(sa, sb)
    # tokens: the loss tokens of every process, as many as in the gathered windows' masks
    masks = [int(wa[f"{k}/mask"].sum()) for k in sorted({int(k.split("/")[0]) for k in wa})]
    assert list(sb["tokens"]) == list(np.cumsum(masks))
    assert {"mass_prefix", "residual_prefix", "rho_prefix", "split_share"} <= set(sa.columns)
    # the token traces (what gradlab view shows) carry the same W
    ta, tb = (gradlab.load_traces(r / "store").sort_values(["step", "group", "row", "position"])
              for r in (one, two))
    assert len(ta) == len(tb) > 0
    np.testing.assert_array_equal(ta["token_id"].to_numpy(), tb["token_id"].to_numpy())
    np.testing.assert_allclose(tb["W"], ta["W"], rtol=RTOL, atol=RTOL * ta["W"].abs().max())
    la, lb = gradlab_logs(one / "log.json"), gradlab_logs(two / "log.json")
    assert len(la) == len(lb) > 0
    for ha, hb in zip(la, lb):
        assert ha.keys() == hb.keys()
        for k in ha:
            assert hb[k] == pytest.approx(ha[k], rel=RTOL, abs=1e-6), k
    # the update (plain SGD; for dfpo and ibpo gradlab's drop-in loss) equals one process's
    ma, mb = load_file(one / "model.safetensors"), load_file(two / "model.safetensors")
    w0 = initial_weights()
    da, db = (np.concatenate([(m[k] - w0[k]).flatten().numpy() for k in w0]) for m in (ma, mb))
    assert np.abs(da).max() > 1e-3 and rel_diff(da, db) < RTOL


def test_resume_on_two_processes(runs, tmp_path):
    """Two processes, 3 steps, checkpoint at 2; resumed from it (the store's last row dropped
    and written again): the store equals one process's uninterrupted run."""
    one, two = runs
    shutil.copytree(two / "dapo", tmp_path / "dapo")
    _launch(tmp_path, 2, "--case", "dapo", "--resume", "2")
    sa = gradlab.load_run(one / "dapo" / "store", wide=True)
    sb = gradlab.load_run(tmp_path / "dapo" / "store", wide=True)
    same_store(sa, sb)
    wa = load_file(one / "dapo" / "windows.safetensors")
    wb = load_file(tmp_path / "dapo" / "resumed_windows.safetensors")
    assert sorted({k.split("/")[0] for k in wb}) == ["2"]  # only the window after the checkpoint
    same_windows(wa, wb, only={"2"})


def main() -> None:
    """`python tests/test_trl_multiprocess.py`: run both layouts and print the agreement (max
    relative difference, one vs two processes) of W, each store metric and the update."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        one, two = Path(tmp) / "one", Path(tmp) / "two"
        _launch(one, 1)
        _launch(two, 2)
        w0 = initial_weights()
        for case in CASES:
            a, b = one / case, two / case
            dw = same_windows(load_file(a / "windows.safetensors"),
                              load_file(b / "windows.safetensors"))
            ds = same_store(gradlab.load_run(a / "store", wide=True),
                            gradlab.load_run(b / "store", wide=True))
            ma, mb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
            da, db = (np.concatenate([(m[k] - w0[k]).flatten().numpy() for k in w0])
                      for m in (ma, mb))
            print(f"{case}: W {max(dw.values()):.1e}, update {rel_diff(da, db):.1e}, metrics:")
            print("  " + ", ".join(f"{k} {v:.1e}" for k, v in sorted(ds.items())))


if __name__ == "__main__":
    main()
