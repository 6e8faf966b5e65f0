"""The numbers quoted in docs/concepts/dfpo.md and figures/README.md: the gradient
identity on tests/test_fair.py's real off-policy minibatch (shipped policy, float64 model).

    OMP_NUM_THREADS=1 python -m analyses.studies.gradient_identity
"""

from __future__ import annotations

import torch

from gradlab import objectives
from tests import test_fair as T  # the test's batch and helpers: one definition


def main() -> None:
    torch.set_num_threads(1)
    model, ro, adv, rows = T.off_policy.__wrapped__()
    g_gspo, b = T._grad(model, ro, rows, adv, objectives.get("gspo").loss)
    print(f"GSPO clip_frac on the batch: {float(objectives.get('gspo').stats(b)['clip_frac']):.3f}")
    for clip, base in (("base", "gspo"), ("free", "gspo[eps=1e9]")):
        gb, _ = T._grad(model, ro, rows, adv, objectives.get(base).loss)
        gr, _ = T._grad(model, ro, rows, adv, T._prefix_residual_loss(objectives.get(base)))
        g = {t: T._grad(model, ro, rows, adv, objectives.get(f"dfpo-{t}[clip={clip}]").loss)[0]
             for t in ("min", "orth")}
        print(f"clip={clip}: ‖g_tax‖/‖g_{base}‖ = {float(gr.norm() / gb.norm()):.3g}; "
              f"min vs base−tax {T._rel(g['min'], gb - gr):.2g}, orth vs base−tax "
              f"{T._rel(g['orth'], gb - gr):.2g}, min vs orth {T._rel(g['min'], g['orth']):.2g}")
    g_min, _ = T._grad(model, ro, rows, adv, objectives.get("dfpo-min[nodes=trie]").loss)
    g_orth, _ = T._grad(model, ro, rows, adv, objectives.get("dfpo-orth[nodes=trie]").loss)
    print(f"nodes=trie: min vs orth {T._rel(g_min, g_orth):.3g}")


if __name__ == "__main__":
    main()
