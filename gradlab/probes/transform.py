"""DFPO as a gradient transform: a hook that turns any base loss's W into DFPO's W̃ (docs/concepts/dfpo.md).

The hook on the (B, T) log-prob tensor receives ∂L/∂l = −W and returns −W̃, so the parameter
gradient is the one of L = −Σ sg(W̃) l, for whatever base loss L was written:

    gspo = objectives.get("gspo")
    with DFPOGradientTransform(batch, "orth", weight=gspo.weight(batch)) as t:
        logps = t.watch(logps)
        gspo.loss(batch.replace(logps=logps)).backward()
    # param.grad == that of objectives.get("dfpo", transform="orth", base="gspo")

W̃ = W + A·(w̃ − w): the A·w part of W is replaced by A·w̃ at the transformed positions, and
anything else in W (a KL term) passes through unchanged; w̃ = w elsewhere, so W̃ = W there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from ..core.batch import TokenBatch
from ..core.dfpo import SCOPES, TRANSFORMS, node_map, transform_weights
from ..core.nodes import NODE_KINDS
from .modulation import check_logps

if TYPE_CHECKING:
    from typing_extensions import Self


class DFPOGradientTransform:
    """Context manager: `watch(logps)` makes the backward pass use DFPO's W̃ instead of W.

    batch: the step's TokenBatch (tokens, mask, advantages, group define the nodes; its logps
    are not used). transform "min" | "orth" | "scale" (factor), scope "shared" | "all",
    nodes "prefix" | "trie", as in `gradlab.core.objectives.DFPO`.

    weight (B, T): the base objective's w with W = A·w (e.g. `objectives.get("gspo").weight(
    batch)`). Given, W̃ − W = A(w̃ − w) is computed here, once, and the hook only adds it: no
    host sync in the hook. Not given — *our choice* — w is derived from the incoming gradient,
    w = W/A on rows with A ≠ 0, and rows with A = 0 are left out of the transform (they are not
    node members for the min or the projection; their W is 0 anyway). This derivation assumes
    W = A·w (no KL or other additive term), and equals the objective's DFPO only when no
    member of a transformed node has A = 0; it runs `transform_weights` inside the hook, whose
    boolean-mask indexing syncs a CUDA device once per backward.

    Only the first backward through the watched tensor is transformed (later passes over a
    retained graph, e.g. `learning_tax`, go through untouched). After it: `W` (B, T) the
    incoming modulation, `W_tilde` (B, T) the one used, both detached. Hook removed on exit.
    """

    def __init__(self, batch: TokenBatch, transform: str = "min", nodes: str = "prefix",
                 scope: str = "shared", weight: Tensor | None = None, factor: float = 0.5) -> None:
        for arg, val, valid in (("transform", transform, TRANSFORMS), ("scope", scope, SCOPES),
                                ("nodes", nodes, NODE_KINDS)):
            if val not in valid:
                raise ValueError(f"DFPOGradientTransform: unknown {arg}={val!r}; valid: {valid}")
        if weight is not None and weight.shape != batch.tokens.shape:
            raise ValueError(f"DFPOGradientTransform: weight is {tuple(weight.shape)}, "
                             f"batch is {tuple(batch.tokens.shape)}")
        self.transform, self.factor = transform, float(factor)
        adv = batch.adv_tokens.detach()  # (B, T): per-sequence advantages broadcast
        node, self._n = node_map(batch, scope, nodes)
        if weight is None:
            node = torch.where(adv != 0, node, -1)  # A = 0 tokens left out (ours)
        self._adv, self._node = adv, node
        self._delta = None if weight is None else self._difference(weight.detach())
        self.W: Tensor | None = None
        self.W_tilde: Tensor | None = None
        self._handle: RemovableHandle | None = None

    def _difference(self, w: Tensor) -> Tensor:
        """(B, T) A·(w̃ − w): what the transform adds to W."""
        wt = transform_weights(w, self._adv, self._node, self._n, self.transform, self.factor)
        return self._adv.to(w.dtype) * (wt - w)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

    def close(self) -> None:
        """Remove the hook (idempotent)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def watch(self, logps: Tensor) -> Tensor:
        """Register the transform on logps (B, T); returns logps (build the loss from it)."""
        check_logps(logps, "DFPOGradientTransform.watch")
        if tuple(logps.shape) != tuple(self._node.shape):
            raise ValueError(f"DFPOGradientTransform.watch: logps is {tuple(logps.shape)}, "
                             f"batch is {tuple(self._node.shape)}")
        if self._handle is not None:
            raise RuntimeError("DFPOGradientTransform.watch: already watching a tensor")
        self._handle = logps.register_hook(self._hook)
        return logps

    def _hook(self, grad: Tensor) -> Tensor | None:
        if self.W_tilde is not None:  # a later pass over the retained graph: leave it alone
            return None
        W = -grad.detach()
        if self._delta is not None:
            delta = self._delta.to(W.dtype)
        else:
            A = self._adv.to(W.dtype)  # (B, T)
            w = torch.where(A != 0, W / torch.where(A != 0, A, 1), 0)
            wt = transform_weights(w, self._adv, self._node, self._n, self.transform, self.factor)
            delta = A * (wt - w)
        self.W, self.W_tilde = W, W + delta
        return -self.W_tilde
