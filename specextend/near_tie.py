"""The near-tie rule for finite precision: a speculative output may differ from plain decoding only
where the target's two best logits (nearly) tie (docs/architecture.md, "Losslessness in finite
precision"). Used by tests and benchmarks."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from specextend.attention.backends import CAUSAL
from specextend.models.decoder import Decoder


def first_divergence(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    """First position where the two token lists differ (a length difference counts); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def within_rounding(gap: float, steps: Optional[float], tol: float) -> bool:
    """A reference override's largest top-two gap is a near-tie: within the dtype's tolerance, or
    within one rounding step of the logits' own magnitude (`steps` <= 1: 0.25 for bfloat16 logits in
    [32, 64), where the fixed 0.125 is half a step; docs/architecture.md, "Baselines")."""
    return gap <= tol or (steps is not None and steps <= 1.0)


@torch.inference_mode()
def top2_gap(decoder: Decoder, ids: Sequence[int]) -> float:
    """The target's top-2 logit gap for the token after `ids` (a fresh causal forward)."""
    cache = decoder.new_cache(len(ids) + 1)
    dev = decoder.device
    logits, _ = decoder.forward(torch.tensor(list(ids), device=dev), torch.arange(len(ids), device=dev), cache,
                                CAUSAL)
    top = torch.topk(logits[-1].float(), 2).values
    return float(top[0] - top[1])


def near_tie_check(decoder: Decoder, prompt: Sequence[int], ref: Sequence[int], out: Sequence[int],
                   tol: float) -> tuple[bool, Optional[int], Optional[float]]:
    """(ok, first divergence, top-2 gap there): ok if identical or the gap there is at most `tol`."""
    i = first_divergence(ref, out)
    if i is None:
        return True, None, None
    if i >= min(len(ref), len(out)):  # one stopped earlier than the other: never a tie
        return False, i, None
    gap = top2_gap(decoder, list(prompt) + list(ref[:i]))
    return gap <= tol, i, gap


@torch.inference_mode()
def rounding_at(decoder: Decoder, ids: Sequence[int], tokens: Sequence[int] = (),
                chunk: int = 2048) -> tuple[float, list[float]]:
    """After `ids`: how far the model's own rounding moves the logits (max over the vocabulary of
    |logits in the model's dtype - logits of the same weights upcast to float32|; 0 in float32/64),
    and the float32 logits of `tokens` there. Each costs a float32 copy of the weights and a prefill."""
    from specextend.target import TargetSession

    ids = list(ids)
    if decoder.dtype in (torch.float32, torch.float64):  # (no noise: a prefill only for logits asked for)
        if not tokens:
            return 0.0, []
        logits = TargetSession(decoder, len(ids) + 1, hybrid=True).prefill(ids, chunk).float()
        return 0.0, [float(logits[t]) for t in tokens]
    ref = Decoder(decoder.args, decoder.w.to(dtype=torch.float32), decoder.rope, decoder.backend)
    out = [TargetSession(dec, len(ids) + 1, hybrid=True).prefill(ids, chunk).float()  # chunked: long contexts fit
           for dec in (decoder, ref)]
    del ref
    return float((out[0] - out[1]).abs().max()), [float(out[1][t]) for t in tokens]


def rounding_noise(decoder: Decoder, ids: Sequence[int], chunk: int = 2048) -> float:
    """rounding_at's noise alone. A bf16 divergence whose top-2 gap is within twice it (each logit
    may move by it) is one that rounding alone can produce; a fixed tolerance of one bf16 ulp is too
    strict for large logits."""
    return rounding_at(decoder, ids, (), chunk)[0]


def float32_tie(decoder: Decoder, ids: Sequence[int], a: int, b: int) -> tuple[bool, float, float]:
    """Whether tokens `a` and `b` after `ids` are a near-tie of the target itself: their float32
    logits (the model's weights, upcast) differ by at most twice its rounding noise there, so that a
    computation in the model's dtype, each logit off by up to the noise, may order them either way
    (docs/architecture.md, "Losslessness in finite precision"). -> (tie, noise, |float32 gap|)."""
    noise, (la, lb) = rounding_at(decoder, ids, (a, b))
    return abs(la - lb) <= 2 * noise, noise, abs(la - lb)


REDUCED = (torch.bfloat16, torch.float16)


def lossless_check(decoder: Decoder, prompt: Sequence[int], ref: Sequence[int], out: Sequence[int],
                   tol: float) -> dict:
    """One output against plain decoding's: identical, near_tie (the verdict), first_divergence,
    top2_gap, tolerance, rounding_noise, float32_gap. In bf16/fp16 a first divergence whose top-2 gap
    exceeds the fixed tolerance (one ulp at logits below 32) still sits at a near-tie when the
    target's float32 logits of the two tokens there differ by at most twice its rounding noise
    (float32_tie), the stated rule for reduced precision (docs/architecture.md, "Losslessness in
    finite precision"). Measured only for such divergences: it costs a float32 copy of the weights
    and a prefill."""
    ok, i, gap = near_tie_check(decoder, prompt, ref, out, tol)
    noise = f32 = None
    if not ok and gap is not None and decoder.dtype in REDUCED:
        ok, noise, f32 = float32_tie(decoder, list(prompt) + list(ref[:i]), ref[i], out[i])
    return dict(identical=i is None, near_tie=ok, first_divergence=i, top2_gap=gap, tolerance=tol,
                rounding_noise=noise, float32_gap=f32)


def settle_overrides(decoder: Decoder, prompt: Sequence[int], reference: Sequence[int], overrides: Sequence,
                     tol: float) -> tuple[bool, Optional[float], Optional[float]]:
    """Reference overrides ([output position, gap, gap in rounding steps, the target's token] each:
    the response's `reference_override_at`, verify.Reference) by the near-tie rule: each within the
    tolerance or one rounding step (`within_rounding`), or else, in bf16/fp16, a near-tie of the
    target itself after `prompt + reference[:position]` (float32_tie of its token and the
    reference's), as `lossless_check` settles a differing output; an override without the target's
    token (an older app's), its gap within twice the rounding noise there (docs/architecture.md,
    "Losslessness in finite precision"). -> (ok, the largest noise and the largest float32 gap
    measured: None where none was). Stops at the first override beyond it."""
    noise = f32 = None
    for position, gap, steps, *token in overrides:
        if within_rounding(gap, steps, tol):
            continue
        if position is None or decoder.dtype not in REDUCED:  # (no position: nowhere to measure)
            return False, noise, f32
        ids = list(prompt) + list(reference[:int(position)])
        if token and token[0] is not None:
            ok, here, apart = float32_tie(decoder, ids, int(token[0]), int(reference[int(position)]))
            f32 = apart if f32 is None else max(f32, apart)
        else:
            here = rounding_noise(decoder, ids)
            ok = gap <= 2 * here
        noise = here if noise is None else max(noise, here)
        if not ok:
            return False, noise, f32
    return True, noise, f32


def all_within_rounding(overrides: Sequence, tol: float) -> bool:
    """Every override ([position, gap, steps, token] each: overrides_of) within the tolerance or one
    rounding step: nothing to settle (within_rounding)."""
    return all(within_rounding(o[1], o[2], tol) for o in overrides)


def overrides_of(result: dict) -> list:
    """A benchmark result's reference overrides ([position, gap, gap in steps, token] each: its
    `reference_override_at`); from an app that reported no positions, its largest gap alone ([None,
    reference_max_gap, reference_max_gap_steps]: only the tolerance or one step settles that); []
    without overrides."""
    if not result.get("reference_overrides"):
        return []
    at = result.get("reference_override_at")
    if at is None:
        return [[None, result["reference_max_gap"], result.get("reference_max_gap_steps")]]
    return [list(o) for o in at]


def reference_check(decoder: Decoder, prompt: Sequence[int], ref: Sequence[int], out: Sequence[int],
                    overrides: Sequence, tol: float) -> dict:
    """`lossless_check` of `out` against `ref`, and where the reference overrode the target's choice
    (`overrides`: overrides_of) those settled too (settle_overrides): near_tie only if both hold,
    rounding_noise and float32_gap the largest measured by either."""
    check = lossless_check(decoder, prompt, ref, out, tol)
    if overrides:
        ok, noise, f32 = settle_overrides(decoder, prompt, ref, overrides, tol)
        largest = {k: max([v for v in (check[k], new) if v is not None], default=None)
                   for k, new in (("rounding_noise", noise), ("float32_gap", f32))}
        check.update(identical=False, near_tie=check["near_tie"] and ok, **largest)
    return check


def check_line(check: dict) -> str:
    """A settled check in words: where it differed or was overridden, the gaps, the noise, the verdict."""
    parts = []
    if check.get("first_divergence") is not None:
        gap = check.get("top2_gap")
        parts.append(f"first difference at {check['first_divergence']}, top-2 gap "
                     + ("-" if gap is None else f"{gap:.4f}"))
    if check.get("overrides"):
        parts.append(f"{check['overrides']} overrides of the target's choice, largest gap {check['max_gap']:.4f}")
    if check.get("rounding_noise") is not None:
        parts.append(f"rounding noise {check['rounding_noise']:.4f} (2x {2 * check['rounding_noise']:.4f})")
    if check.get("float32_gap") is not None:
        parts.append(f"float32 gap {check['float32_gap']:.4f}")
    return "; ".join(parts or ["identical"]) + (": near-tie" if check["near_tie"] else ": DIVERGED")
