"""The persistent layer kernel (models/persistent.py): its twin (one launch per stage) against the
plain forward and the fused plan on the CPU (Triton's interpreter); on CUDA the one-launch layer
against its twin, equal to the bit, and the captured graphs and tree expansions through it."""

import pytest
import torch

pytest.importorskip("triton")  # a dev dependency: present in CI

from specextend.models import persistent
from specextend.models.full_graphs import FullStepGraphs
from specextend.models.graphs import ShapeKey

from test_full_graphs import DEVICE
from test_graphs import assert_same_run, decoder_on, run_calls

CUDA = torch.cuda.is_available()


@pytest.mark.parametrize("name", ["llama3", "qwen2"])
def test_persistent_twin_equals_eager(name):
    """Every decode-time call kind (AR, verification with CMR capture, draft levels with staged
    keys and the retrieval store) through the layer kernel's stages equals the plain forward; the
    tiny models' head dim of 16 leaves half of each QKV item's columns masked."""
    dec = decoder_on(name, DEVICE, torch.float32)
    ref = run_calls(dec, dec.forward_eager, DEVICE)
    graphs = FullStepGraphs(dec, capture=False, fused=True, persistent=True)
    graphs.persist_launch = False
    got = run_calls(dec, graphs.forward, DEVICE)
    assert_same_run(ref, got, atol=1e-5, rtol=1e-5)
    assert all(hasattr(p, "sync") for p in graphs.plans.values())  # every plan took the persistent body


def test_persistent_half_precision_twin_equals_fused_plan():
    dt = torch.bfloat16 if CUDA else torch.float16
    dec = decoder_on("qwen2", DEVICE, dt)
    ref = run_calls(dec, FullStepGraphs(dec, capture=False, fused=True).forward, DEVICE)
    graphs = FullStepGraphs(dec, capture=False, fused=True, persistent=True)
    graphs.persist_launch = False
    assert_same_run(ref, run_calls(dec, graphs.forward, DEVICE), atol=3e-2, rtol=3e-2)


def test_persistent_refuses_qk_norm_and_leaves_large_forwards_to_the_fused_plan():
    with pytest.raises(ValueError, match="without QK-norm"):
        FullStepGraphs(decoder_on("qwen3", DEVICE, torch.float32), capture=False, fused=True, persistent=True)
    dec = decoder_on("llama3", DEVICE, torch.float32)
    graphs = FullStepGraphs(dec, capture=False, fused=True, persistent=True)
    assert graphs._persists(type("P", (), {"key": ShapeKey(16, 0, 0, False, False)})())
    assert not graphs._persists(type("P", (), {"key": ShapeKey(17, 0, 0, False, False)})())
    assert not persistent.supported(decoder_on("qwen3", DEVICE, torch.float32))


def test_stage_items_cover_the_layer():
    """Work items per stage for the 0.5B draft's tree level (4 rows): QKV 18 heads x 2 chunks of 16
    pairs, prefix 1 row block x S splits x 2 KV heads, combine 2 x 2 x 4, o-proj 56 column blocks,
    gate/up 304, down 56."""
    from specextend.models.args import ModelArgs

    a = ModelArgs(model_type="qwen2", vocab_size=10, hidden_size=896, intermediate_size=4864, num_layers=24,
                  num_heads=14, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6, max_position_embeddings=32768,
                  qkv_bias=True, qk_norm=False, tie_word_embeddings=True, eos_token_ids=(0,))
    assert persistent.stage_items(a, 4, 8, 32, 16, 16, 16) == [36, 16, 16, 56, 304, 56]


@pytest.mark.skipif(not CUDA, reason="the cooperative launch needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("capture", [False, True])
def test_persistent_launch_equals_its_twin_to_the_bit(dtype, capture):
    """Each work item computes the same thing in either launch: any difference is a barrier that
    let a stage read what an earlier one had not yet written."""
    dec = decoder_on("qwen2", "cuda", dtype)
    twin = FullStepGraphs(dec, capture=False, fused=True, persistent=True)
    twin.persist_launch = False
    ref = run_calls(dec, twin.forward, "cuda")
    got = run_calls(dec, FullStepGraphs(dec, capture=capture, fused=True, persistent=True).forward, "cuda")
    assert_same_run(ref, got, atol=0, rtol=0)


@pytest.mark.skipif(not CUDA, reason="the cooperative launch needs a CUDA device")
def test_persistent_launch_at_the_draft_geometry_equals_the_fused_plan():
    """The 0.5B draft's geometry (random weights): 14 heads over 2 KV heads of 64 dims, 896 wide,
    every stage with many items per program when the grid is cut to 8 programs."""
    from specextend.models.loader import load_model

    dec = load_model("random:qwen2.5-0.5b", "draft", dtype="bfloat16", device="cuda", execution="eager").decoder
    ref = run_calls(dec, FullStepGraphs(dec, capture=True, fused=True).forward, "cuda")
    for programs in (0, 8):
        graphs = FullStepGraphs(dec, capture=True, fused=True, persistent=True)
        graphs.num_sms = programs or graphs.num_sms
        assert_same_run(ref, run_calls(dec, graphs.forward, "cuda"), atol=1e-1, rtol=1e-1)
