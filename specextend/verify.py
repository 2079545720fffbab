"""Lossless verification of a draft tree against the target's logits (docs/architecture.md, "Verification"). Pure functions.

Walk from the root: at each node draw the target's token (argmax, or a sample from the target
distribution with the request's generator); descend into the child carrying that token if there
is one, else it is the bonus token. Accepted path + bonus = exactly what the target alone emits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from specextend.config import SamplingParams
from specextend.models.transfer import to_device
from specextend.sampling import next_token, rewind, sample_rows
from specextend.tree import children_of, node_depths


def rounding_step(magnitude: float, dtype: torch.dtype) -> float:
    """The spacing of `dtype`'s values at `magnitude` (one rounding step: bfloat16 0.125 for
    logits in [16, 32), 0.25 in [32, 64)): the most two computations of one logit that differ only
    in rounding can part by, per rounding of the result."""
    m = abs(magnitude)
    if m == 0 or not math.isfinite(m):
        return torch.finfo(dtype).tiny
    return torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(m))


@dataclass
class Reference:
    """Benchmarks only: the tokens a greedy request emits, given in advance (served `ar`'s output
    for the same prompt), so that every mode decodes the same text. In finite precision two modes'
    greedy outputs part at the first near-tie of the target's logits (docs/architecture.md,
    "Losslessness in finite precision"), after which their texts, and so their acceptance, differ:
    per-text speeds would compare different texts. Where the target's choice differs from the
    reference, the reference's token is emitted and the target's top-two gap there (its logit less
    the reference's) is kept in `gaps`, and beside it in `steps` the rounding step of the model's
    dtype (`dtype`, default the logits') at the larger of the two logits, in `positions` the output
    position and in `chosen` the target's own token; the benchmark checks each against the near-tie
    tolerance, or one rounding step where the logits are large, or else by the target's float32
    logits of the two tokens there against its rounding noise (near_tie.settle_overrides), so a real
    divergence is still caught."""

    tokens: Sequence[int]
    gaps: list = field(default_factory=list)
    steps: list = field(default_factory=list)
    positions: list = field(default_factory=list)
    chosen: list = field(default_factory=list)
    dtype: Optional[torch.dtype] = None

    def pick(self, logits: torch.Tensor, row: int, tok: int, position: int) -> int:
        """The token to emit at output `position` (0: the first) for logits [R, V] row `row`, where
        the target chose `tok`."""
        if position >= len(self.tokens) or int(self.tokens[position]) == tok:
            return tok
        want = int(self.tokens[position])
        self.note(float(logits[row, tok].float()), float(logits[row, want].float()), position, tok, logits.dtype)
        return want

    def note(self, mine: float, theirs: float, position: int, tok: int, dtype: torch.dtype) -> None:
        """An override at output `position`: the target chose `tok` (logit `mine`) over the
        reference's token (`theirs`); logits of `dtype` (pick's, and lookup runs' from the device)."""
        self.gaps.append(mine - theirs)
        self.steps.append(rounding_step(max(abs(mine), abs(theirs)), self.dtype or dtype))
        self.positions.append(position)
        self.chosen.append(tok)


@dataclass(frozen=True)
class Verdict:
    accepted: list[int]  # accepted node indices (tree order, root excluded), root to leaf
    tokens: list[int]  # emitted tokens: accepted nodes' tokens + bonus
    bonus_token: int

    @property
    def accept_length(self) -> int:
        return len(self.accepted)


def sampled_rows(logits: torch.Tensor, parents: Sequence[int], params: SamplingParams,
                 generator: torch.Generator) -> tuple[list[int], torch.Tensor]:
    """Every row's sample at once: row r (the root 0, node i at i + 1) with the uniform of its
    depth, the draw that plain decoding would make for the token at that position, all drawn now
    (sampling.sample_rows: one search over the rows on the device, one read). -> (the samples, the
    generator's state before the draws: `verify_tree` leaves it as if it had drawn only one per
    emitted token)."""
    depth = [0] + node_depths(parents)  # [N + 1]: the root's row, then each node's
    state = generator.get_state()
    u = torch.rand((max(depth) + 1,), generator=generator, dtype=torch.float64)  # [D + 1]
    rows = sample_rows(logits, params, to_device(u[depth], torch.float64, logits.device))  # [N + 1]
    return rows.tolist(), state


def verify_tree(logits: torch.Tensor, tokens: Sequence[int], parents: Sequence[int],
                params: SamplingParams, generator: Optional[torch.Generator],
                forced_length: Optional[int] = None, draft_bonus: bool = False,
                reference: Optional[Reference] = None, emitted: int = 0, at_once: Optional[bool] = None) -> Verdict:
    """logits [N+1, V] of [root] + nodes. `forced_length` (acceptance replay, not lossless)
    accepts that many nodes along the draft's best branch (first child) instead; its bonus token is
    the target's, or with `draft_bonus` the draft's second choice where the path stops (its second
    child, if it has one there): a verdict that an overlapping draft can have in its pool, as real
    verdicts mostly are (random weights' own bonus tokens never are). `reference` (benchmarks,
    greedy): the tokens to emit from output position `emitted` on (Reference). Sampled on a GPU
    (`at_once`, by default where the logits are on CUDA), every row is sampled at once
    (`sampled_rows`) and the generator then set to one draw per emitted token: its twin, the CPU's
    way, samples one row after another along the path (`next_token`), which there costs a row's
    work per row sampled (a GPU's extra rows cost next to nothing; a CPU's cost what they hold)."""
    children = children_of(parents)
    greedy_rows = torch.argmax(logits, dim=-1).tolist() if params.greedy else None
    state, at_once = None, logits.is_cuda if at_once is None else at_once
    if greedy_rows is None and at_once and forced_length is None and generator is not None:
        greedy_rows, state = sampled_rows(logits, parents, params, generator)  # (the rows' samples)
    accepted: list[int] = []
    row = 0  # verification row of the current node (root = 0)
    while True:
        kids = children[row]
        if forced_length is not None and kids and len(accepted) < forced_length:
            nxt = kids[0]  # replay: the draft's best branch, no token drawn
        else:
            tok = greedy_rows[row] if greedy_rows is not None else next_token(logits[row], params, generator)
            if reference is not None:
                tok = reference.pick(logits, row, tok, emitted + len(accepted))
            if forced_length is not None and draft_bonus and len(kids) > 1:
                tok = tokens[kids[1]]
            nxt = None if forced_length is not None else next((c for c in kids if tokens[c] == tok), None)
            if nxt is None:
                break
        accepted.append(nxt)
        row = nxt + 1
    if state is not None:  # one draw per emitted token, as plain decoding's
        rewind(generator, state, len(accepted) + 1)
    return Verdict(accepted=accepted, tokens=[tokens[c] for c in accepted] + [tok], bonus_token=tok)
