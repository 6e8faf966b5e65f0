"""Instrument one training step of a Hugging Face model: measured W, the residual, the tax.

A tiny Qwen3 is built from a config (random weights, nothing downloaded). One group of G
responses to one prompt is sampled; every response starts with the same 3-token template (as a
chat template or an answer prefix would), so the group shares a prefix, and responses get
unequal lengths. On this on-policy step (the first minibatch after sampling), for three losses
built from the model's log-probs, a `ModulationProbe` hook measures W = −∂loss/∂log π on the
real backward pass, and gradlab reports ρ at the shared nodes, how far the hook's W is from the
closed form, and the learning tax ‖g_tax‖ / ‖g‖. Token-mean GRPO and
DFPO cancel (ρ at float round-off); GSPO does not: its 1/T_i weights differ between responses of
unequal length at the tokens they share.

    python examples/instrument_step.py                 # G = 8, 16 sampled tokens
    python examples/instrument_step.py --G 4 --tokens 6
"""

import argparse
import math

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import gradlab
from gradlab import objectives
from gradlab.probes import ModulationProbe, defined_ratio, learning_tax


def token_logps(model, ids: torch.Tensor, P: int) -> torch.Tensor:
    """(B, T) log π of the response tokens ids[:, P:] given everything before them."""
    logits = model(ids).logits[:, P - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, P:, None]).squeeze(-1)


def main(G: int, tokens: int, seed: int) -> None:
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model = Qwen3ForCausalLM(cfg)
    prompt, template = torch.randint(4, 32, (6,)), torch.tensor([1, 2, 3])
    ids = torch.cat([prompt, template]).repeat(G, 1)
    P = len(prompt)
    with torch.no_grad():                      # sample G continuations, temperature 1
        for _ in range(tokens):
            nxt = torch.multinomial(torch.softmax(model(ids).logits[:, -1], -1), 1)
            ids = torch.cat([ids, nxt], 1)
    T = ids.shape[1] - P
    lengths = torch.randint(T // 2, T + 1, (G,))
    mask = torch.arange(T)[None] < lengths[:, None]           # (G, T) unequal lengths
    rewards = (torch.randperm(G) % 2).float()                 # half right, half wrong
    group = torch.zeros(G, dtype=torch.long)
    A = gradlab.advantages(rewards, group)
    with torch.no_grad():
        old = token_logps(model, ids, P)                      # behaviour = current: on-policy

    print(f"{'objective':<10} {'rho_prefix':>11} {'max|W-W_closed|':>16} {'tax_share':>10}")
    for name in ("grpo", "gspo", "dfpo-orth"):
        obj = objectives.get(name)
        model.zero_grad()
        logps = token_logps(model, ids, P)
        with ModulationProbe() as probe:
            loss, _ = obj(gradlab.TokenBatch(ids[:, P:], mask, probe.watch(logps), old, A, group))
            loss.backward(retain_graph=True)
        batch = gradlab.TokenBatch(ids[:, P:], mask, logps.detach(), old, A, group)
        rho = defined_ratio(gradlab.cancellation(probe.W, batch, nodes="prefix"))
        dev = (probe.W - obj.modulation(batch)).abs().max().item()
        tax = learning_tax(logps, probe.W, batch, dict(model.named_parameters()))
        share = tax["tax_share"].item()  # NaN when the gradient is 0: undefined, not 0
        print(f"{name:<10} {_show(rho, 'no full-group token' if not tax['n_nodes'] else TIED):>11} "
              f"{dev:>16.3g} {_show(share, 'no gradient'):>10}")


TIED = "no gradient at shared tokens"


def _show(x: float, why: str) -> str:
    """x, or "—" and why where it is undefined (NaN)."""
    return f"— ({why})" if math.isnan(x) else f"{x:.3g}"


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--G", type=int, default=8, help="responses in the group")
    p.add_argument("--tokens", type=int, default=16, help="sampled tokens after the template")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    main(a.G, a.tokens, a.seed)
