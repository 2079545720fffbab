"""What a successor-weights model proposes (models/presets.py, `<preset>-succ`): over random
tokens, how often its first choice is each token's first successor (the greedy token of every
successor model: a pair's target and draft agree there), and the mean probability of its first
four choices.

  python benchmarks/successor_check.py --spec random:llama-68m-succ --vocab 128256
"""

from __future__ import annotations

import argparse

import torch

from specextend.attention.backends import CAUSAL
from specextend.models import presets
from specextend.models.loader import load_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec", default="random:llama-68m-succ")
    p.add_argument("--vocab", type=int, default=128256, help="the target's vocabulary (the 8B's by default)")
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--dtype", default="float32")
    a = p.parse_args()
    m = load_model(a.spec, "draft", a.dtype, "cpu", vocab_size=a.vocab)
    gen = torch.Generator().manual_seed(presets.SEED + 2)  # the construction's permutations
    first = torch.argsort(torch.randperm(a.vocab, generator=gen))  # [V]: each token's first successor
    ids = torch.randint(0, a.vocab, (a.tokens,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits, _ = m.decoder.forward(ids, torch.arange(a.tokens), m.decoder.new_cache(a.tokens), CAUSAL)
    top = torch.topk(torch.softmax(logits.float(), -1), len(presets.SUCC_LOGITS), -1)  # [T, K]
    q = torch.quantile(top.values[:, 0], torch.tensor([0.1, 0.5, 0.9])).tolist()
    print(f"{a.spec} (vocabulary {a.vocab}, {a.tokens} random tokens): first choice = first successor "
          f"{(top.indices[:, 0] == first[ids]).float().mean().item():.1%}; mean probabilities of the first four "
          f"{', '.join(f'{x:.3f}' for x in top.values.mean(0).tolist())}; first's 10/50/90th percentiles "
          f"{', '.join(f'{x:.2f}' for x in q)}")


if __name__ == "__main__":
    main()
