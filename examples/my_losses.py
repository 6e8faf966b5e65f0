"""Two losses of your own, trained beside the built-in objectives:

    gradlab tandem --objectives examples/my_losses.py:dr_grpo,grpo,gspo --steps 10 --out runs/own
    gradlab tandem --objectives 'examples/my_losses.py:seq_clip[name=myclip],gspo' --out runs/clip

A loss takes a `gradlab.TokenBatch` and returns a scalar tensor differentiable in
`batch.logps`; every field it may read is described in docs/guides/loss-contract.md.
"""

import torch

EPS = 0.2  # PPO clip range of dr_grpo
SEQ_EPS = (3e-4, 4e-4)  # sequence-ratio clip range of seq_clip (GSPO's)


def dr_grpo(batch):
    """Dr. GRPO: the token-ratio PPO-clip surrogate summed over tokens and divided by a
    constant, sequences × padded width, so long responses are not down-weighted."""
    m = batch.mask.float()  # (B, T), 1 on response tokens including the EOS
    ratio = torch.exp(batch.logps - batch.old_logps)  # (B, T) π_θ / π_old
    adv = batch.advantages.unsqueeze(-1)  # (B, 1) group-normalised A_i
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - EPS, 1 + EPS) * adv)
    # the step's totals, not this micro-batch's: micro-batches add up to the whole step
    return -(surrogate * m).sum() / (batch.norm_seqs * batch.norm_width)


def _dr_grpo_modulation(batch):
    """Closed form W = −∂loss/∂logps (B, T): A r 1[unclipped] / (B T_max); the loop checks
    it against the W it measures at the first step."""
    ratio = torch.exp(batch.logps - batch.old_logps)
    adv = batch.advantages.unsqueeze(-1)
    clipped = ((adv > 0) & (ratio > 1 + EPS)) | ((adv < 0) & (ratio < 1 - EPS))
    return adv * ratio * ~clipped * batch.mask / (batch.norm_seqs * batch.norm_width)


dr_grpo.modulation = _dr_grpo_modulation  # optional: without it W is measured only


def seq_clip(batch):
    """A sequence-level clip (GSPO's): one ratio per response, the geometric mean of its token
    ratios, clipped as a whole; the loss is the mean over sequences."""
    m = batch.mask.float()
    length = m.sum(-1).clamp(min=1)  # (B,) T_i, response tokens of each row
    log_s = ((batch.logps - batch.old_logps) * m).sum(-1) / length  # (B,) mean log-ratio
    s = torch.exp(log_s)  # (B,) sequence ratio s_i
    adv = batch.advantages  # (B,)
    lo, hi = SEQ_EPS
    surrogate = torch.minimum(s * adv, s.clamp(1 - lo, 1 + hi) * adv)
    return -surrogate.sum() / batch.norm_seqs
