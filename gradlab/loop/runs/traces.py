"""Token traces: what one step's W was, token by token, kept in the run folder.

Every `trace_every` rollout steps (step 0 included) the loop records, for the first
`trace_groups` groups of the rollout batch, one row per (objective, step, opt_step, group, row,
position) of a masked-in response token:

    objective, step, opt_step   objective label, rollout step, optimizer step within it
    group, row, position        group label, row within the group (0..G−1), response position
    token_id, text              token id and its decoded text ("" when no tokenizer)
    mask                        True (only masked-in tokens are written)
    A                           the row's advantage
    r                           token ratio exp(l − l_old)
    s                           sequence ratio exp(mean_t(l − l_old)) (GSPO's s_i)
    W                           hook-measured W = −∂loss/∂l (docs/concepts/modulation.md), the loss's own scale
    W_closed                    the objective's closed-form W on the same batch (NaN if none)
    clip                        True where the objective's clip zeroes W (closed form with the
                                clip switched off is non-zero, with it on zero)
    prefix_node, trie_node      node ids at full-group and trie nodes of that optimizer step's
                                batch (−1: not shared); ids are local to the optimizer step
    trie_size                   members of the trie node (0 when not shared)
    parent, branch_at           tree and repair layouts: the row (within the group) this row
                                branched from or repairs, and the response position it was
                                re-sampled from; −1 for independent samples and roots

Layout: run/traces/<objective>/step<NNNNNN>.parquet, one file per (objective, step), written to
a temporary name and renamed, so a crash leaves whole files only; on resume the files of steps
at or after the checkpoint are dropped (like the metrics). `load_traces` reads them back.
Which groups: the lowest group labels present in this process's rollout (under DDP, rank 0's).
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from ...atomic import fsync_file, remove, writing
from ...core.batch import TokenBatch
from ...core.nodes import shared_nodes

log = logging.getLogger("gradlab")

COLUMNS = ("objective", "step", "opt_step", "group", "row", "position", "token_id", "text",
           "mask", "A", "r", "s", "W", "W_closed", "clip", "prefix_node", "trie_node",
           "trie_size", "parent", "branch_at")
_FILE = re.compile(r"step(\d+)\.parquet$")


@torch.no_grad()
def token_rows(batch: TokenBatch, W: Tensor, *, objective=None, keep: Tensor | None = None,
               row_in_group: Tensor | None = None, parent: Tensor | None = None,
               branch_at: Tensor | None = None) -> dict[str, np.ndarray]:
    """Trace columns (module docstring) of rows `keep` (default all) of one optimizer step.

    batch: the step's TokenBatch (B, T); W (B, T) hook-measured; objective: computes the
    closed form and the clip flag on the *whole* batch (normalisers and DFPO nodes need it),
    then the rows are sliced. row_in_group (B,): each row's index within its group; parent,
    branch_at (B,): the layout's `parent`/`branch_at` columns (default −1).
    Returns numpy columns, one entry per masked-in token of the kept rows.
    """
    keep = torch.arange(batch.B, device=W.device) if keep is None else keep
    d = (batch.logps.detach().float() - batch.old_logps.float()) * batch.mask
    r = torch.exp(d)
    s = torch.exp(d.sum(-1) / batch.mask.sum(-1).clamp(min=1)).unsqueeze(-1).expand_as(r)
    nan = torch.full_like(r, float("nan"))
    W_closed, clip = nan, torch.zeros_like(batch.mask)
    if objective is not None:
        W_closed = objective.modulation(batch).float()
    if objective is not None and getattr(objective, "mechanisms", True):  # a user loss: no clip flag
        base = getattr(objective, "base", objective)  # DFPO: a Min-Replace zero is not a clip
        w, w_off = base.policy_modulation(batch), base.policy_modulation(batch, ("clip",))
        clip = (w == 0) & (w_off != 0) & batch.mask
    trie = shared_nodes(batch, "trie")
    prefix = trie.full_group()
    size = torch.where(trie.node >= 0, trie.size[trie.node.clamp(min=0)] if trie.n else 0, 0)
    rig = torch.zeros(batch.B, dtype=torch.long) if row_in_group is None else row_in_group
    B, T = batch.mask.shape
    grid = {
        "group": batch.group.unsqueeze(-1).expand(B, T), "row": rig.to(W.device).unsqueeze(-1).expand(B, T),
        "position": torch.arange(T, device=W.device).expand(B, T), "token_id": batch.tokens,
        "mask": batch.mask, "A": batch.adv_tokens.float(), "r": r,
        "s": s, "W": W.float(), "W_closed": W_closed, "clip": clip, "prefix_node": prefix.node,
        "trie_node": trie.node, "trie_size": size,
    }
    for name, v in (("parent", parent), ("branch_at", branch_at)):
        v = torch.full((B,), -1, dtype=torch.long) if v is None else v
        grid[name] = v.to(W.device).unsqueeze(-1).expand(B, T)
    sel = batch.mask[keep]
    return {k: v[keep][sel].cpu().numpy() for k, v in grid.items()}


def row_in_group(group: Tensor) -> Tensor:
    """(N,) index of each row among the earlier rows of its group (rollout order)."""
    same = group.unsqueeze(0) == group.unsqueeze(1)  # (N, N)
    return torch.tril(same, diagonal=-1).sum(-1)


class TraceWriter:
    """Collects trace rows during one rollout step of one objective and writes them at its end.

    write=False (DDP ranks ≠ 0, or probes off): every method is a no-op. `start`: first step
    this process runs; on resume the files of steps ≥ start are deleted (written after the
    checkpoint).
    """

    def __init__(self, run: str | Path, every: int, groups: int, tok=None, write: bool = True,
                 start: int = 0) -> None:
        self.path = Path(run) / "traces"
        self.every, self.groups, self.tok = every, groups, tok
        self.write = write and every > 0 and groups > 0
        self._key: tuple[str, int] | None = None
        self._parts: list[dict] = []
        self._opt = 0
        if self.write and start > 0:
            for f in self.path.glob("*/step*.parquet"):
                if int(_FILE.search(f.name).group(1)) >= start:
                    f.unlink()

    def begin(self, objective: str, step: int) -> None:
        """Start a rollout step of `objective` (traced when step % every == 0)."""
        on = self.write and step % self.every == 0
        self._key, self._parts, self._opt = ((objective, step) if on else None), [], 0

    def record(self, ro, rows: Tensor, batch: TokenBatch, W: Tensor | None, objective) -> None:
        """One optimizer step on rows `rows` of rollout `ro` (called after the backward)."""
        if self._key is None or W is None:
            self._opt += 1
            return
        labels = torch.unique(ro.group)[: self.groups]
        keep = torch.isin(batch.group, labels).nonzero().squeeze(-1)
        if keep.numel():
            rig = row_in_group(ro.group)
            par = at = None
            if ro.parent is not None:  # tree / repair: the parent's row within the group
                p = ro.parent[rows]
                par, at = torch.where(p >= 0, rig[p.clamp(min=0)], -1), ro.branch_at[rows]
            cols = token_rows(batch, W, objective=objective, keep=keep, row_in_group=rig[rows],
                              parent=par, branch_at=at)
            cols["opt_step"] = np.full(len(cols["W"]), self._opt)
            self._parts.append(cols)
        self._opt += 1

    def end(self) -> Path | None:
        """Write the rollout step's file (temp name, then rename); returns its path."""
        if self._key is None:
            return None
        objective, step = self._key
        self._key = None
        cols = {k: np.concatenate([p[k] for p in self._parts]) for k in self._parts[0]} \
            if self._parts else {c: np.array([]) for c in COLUMNS if c not in ("objective", "step")}
        df = pd.DataFrame(cols)
        df.insert(0, "objective", objective)
        df.insert(1, "step", step)
        df["text"] = [self._text(int(t)) for t in df["token_id"]] if len(df) else []
        df = df[list(COLUMNS)].sort_values(["opt_step", "group", "row", "position"], kind="stable")
        d = self.path / _safe(objective)
        out = d / f"step{step:06d}.parquet"
        tmp = out.with_name(out.name + ".tmp")
        try:  # temp name, fsync, rename: a reader sees whole files only (gradlab/atomic.py)
            with writing(out):
                d.mkdir(parents=True, exist_ok=True)
                df.reset_index(drop=True).to_parquet(tmp, index=False)
            fsync_file(tmp)
            with writing(out):
                os.replace(tmp, out)
        except BaseException:
            remove(tmp)
            raise
        return out

    def _text(self, tid: int) -> str:
        if self.tok is None:
            return ""
        if tid == getattr(self.tok, "eos_token_id", None):
            return "EOS"
        return self.tok.decode([tid])


def _safe(name: str) -> str:
    """An objective label as a folder name (TRL labels hold '+')."""
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", name)


def load_traces(run: str | Path, objective: str | None = None,
                step: int | None = None) -> pd.DataFrame:
    """The token traces of a run folder as one tidy DataFrame (columns: `COLUMNS` + run).

    objective / step filter by label and rollout step. Raises FileNotFoundError naming the folder
    when the run has no traces (an old run, or --trace-every 0). On a run being written it
    returns the steps whose files are complete (files appear whole, by rename); an unreadable
    file is skipped with a warning naming it.
    """
    run = Path(run)
    base = run / "traces"
    if not base.is_dir():
        raise FileNotFoundError(f"no traces/ in {run} (run made with --trace-every 0, or before "
                                "traces existed)")
    dirs = [base / _safe(objective)] if objective is not None else sorted(base.iterdir())
    files = [f for d in dirs for f in sorted(d.glob("step*.parquet"))
             if step is None or int(_FILE.search(f.name).group(1)) == step]
    if not files:
        raise FileNotFoundError(f"no traces in {base} for objective={objective!r}, step={step!r}")
    frames = [df for df in map(_read_trace, files) if df is not None]
    if not frames:
        raise FileNotFoundError(f"no readable traces in {base} for objective={objective!r}, "
                                f"step={step!r}")
    df = pd.concat(frames, ignore_index=True)
    df.insert(0, "run", run.name)
    return df


def _read_trace(path: Path) -> pd.DataFrame | None:
    """One step's trace file; None (logged) when it vanished since it was listed (a resume
    deleting steps after its checkpoint) or cannot be read (a file system that lost it)."""
    try:
        return pd.read_parquet(path)
    except FileNotFoundError:
        return None
    except Exception as e:  # Arrow raises its own error types for a damaged file
        log.warning("%s: trace file not read (%s)", path, str(e).splitlines()[0][:120])
        return None


def record_trace(tracer: TraceWriter | None, objective, ro, rows: Tensor, batch: TokenBatch,
                 W: Tensor | None) -> None:
    """The loop's one call (gradlab.loop.update.step): hand an optimizer step to the learner's
    writer (None: the learner is not traced)."""
    if tracer is not None:
        tracer.record(ro, rows, batch, W, objective)


def trace_window(run: str | Path, objective: str, window, tok=None, groups: int = 2) -> Path | None:
    """Trace one TRL window (gradlab.integrations.trl.Window) like a loop step: step = the
    window index, opt_step = the trainer's optimizer step of each row. TRL's loss has no gradlab closed
    form here, so W_closed is NaN and clip False (the hook-measured W is TRL's own)."""
    b = window.batch
    labels = torch.unique(b.group)[:groups]
    keep = torch.isin(b.group, labels).nonzero().squeeze(-1)
    w = TraceWriter(run, 1, groups, tok)
    w.begin(objective, int(window.index))
    if keep.numel():
        cols = token_rows(b, window.W, objective=None, keep=keep,
                          row_in_group=row_in_group(b.group))
        cols["opt_step"] = window.opt[keep].unsqueeze(-1).expand(-1, b.T)[b.mask[keep]].cpu().numpy()
        w._parts.append(cols)
    return w.end()
