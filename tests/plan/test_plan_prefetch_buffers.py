"""The planner's ZeRO-3 gather buffers: the unit being computed plus `prefetch` units gathered ahead, each the size
of the largest layer in the compute dtype; ZeRO 0-2 hold no gathered copy. Beside them, at a backward moment, that
layer's gradient before its reduce-scatter (reduce dtype) or before it is added to the accumulated ones (ZeRO-1:
compute dtype). Checked against the largest FSDP unit counted by hand from the model's dimensions: a
decoder layer (llama2-7b) or the vocabulary-sized embedding (llama-1b, 128k vocabulary)."""

from __future__ import annotations

import pytest

from framework.plan.layout import Layout, Precision, Workload
from framework.plan.memory import peak_memory, rank_memory
from models.config import model_config

# preset: (hidden, heads x head_dim, KV heads x head_dim, SwiGLU ffn, vocabulary)
DIMS = {"llama-1b": (2048, 32 * 64, 8 * 64, 8192, 128256), "llama2-7b": (4096, 32 * 128, 32 * 128, 11008, 32000)}


def _largest_unit_by_hand(preset: str, tp: int) -> int:
    d, q, kv, ffn, vocab = DIMS[preset]
    layer = (2 * q * d + 2 * kv * d) // tp + 3 * d * ffn // tp + 2 * d  # two RMSNorm weights, replicated over tp
    return max(layer, vocab // tp * d)


@pytest.mark.parametrize("preset", list(DIMS))
@pytest.mark.parametrize("tp", [1, 2])
def test_zero3_buffers_grow_by_one_unit_per_prefetched_unit(preset: str, tp: int) -> None:
    work = Workload(model_config(preset), 2048, 64)
    prec = work.precision
    assert (prec.param, prec.grad) == (2, 4)
    layer = _largest_unit_by_hand(preset, tp)
    for z in (0, 1, 2, 3):
        for prefetch in (0, 1, 2):
            lay = Layout(tp=tp, dp=8, zero_stage=z, prefetch=prefetch)
            mem = rank_memory(work, lay, 0)
            want = layer * (1 + prefetch) * prec.param if z == 3 else 0
            assert mem["comm_buffers"] == want, (z, prefetch, mem["comm_buffers"], want)
            grads = layer * (prec.param if z == 1 else prec.grad)
            assert mem["layer_grads"] in (0.0, grads), (z, prefetch, mem["layer_grads"], grads)
    # the peak sees it too: each prefetched unit adds exactly one bf16 layer to the ZeRO-3 peak
    peaks = [peak_memory(work, Layout(tp=tp, dp=8, zero_stage=3, prefetch=p))[0] for p in (0, 1, 2)]
    assert peaks[1] - peaks[0] == pytest.approx(2 * layer) and peaks[2] - peaks[1] == pytest.approx(2 * layer)
    assert peak_memory(work, Layout(tp=tp, dp=8, zero_stage=2, prefetch=2))[0] == \
        peak_memory(work, Layout(tp=tp, dp=8, zero_stage=2, prefetch=0))[0]


def test_fp32_training_gathers_fp32_units() -> None:
    work = Workload(model_config("llama2-7b"), 2048, 64, Precision.named("fp32"))
    got = rank_memory(work, Layout(dp=8, zero_stage=3, prefetch=1), 0)["comm_buffers"]
    assert got == _largest_unit_by_hand("llama2-7b", 1) * 2 * 4  # the unit and one prefetched, fp32


def test_logits_and_cp_mask_bytes_by_hand() -> None:
    """The last stage's logits are vocab/tp wide (bf16 activations plus the fp32 loss copy); a cp rank holds one
    (b, 1, s/cp, s) additive mask per in-flight micro-batch under the all-gather exchange."""
    from framework.plan.memory import cp_mask_bytes

    work = Workload(model_config("llama2-7b"), 4096, 64)
    for tp in (1, 2, 8):
        got = rank_memory(work, Layout(tp=tp, dp=8 // tp, micro_batch=2), 0)["logits"]
        assert got == 4096 * 2 * (32000 // tp) * (2 + 4)
    assert cp_mask_bytes(4096, 2, 1, 2) == 0
    assert cp_mask_bytes(4096, 2, 2, 2) == 2 * 2 * 2048 * 4096
    gather = Workload(model_config("llama2-7b"), 4096, 64, cp_comm="allgather")
    parts = rank_memory(gather, Layout(cp=2, dp=4, micro_batch=2), 0)
    assert parts["cp_mask"] == 2 * 2 * 2048 * 4096  # one micro-batch in flight without pipelining
    assert rank_memory(work, Layout(cp=2, dp=4, micro_batch=2), 0)["cp_mask"] == 0  # the ring takes no mask


def test_korthikanti_activations_follow_the_attention_kernel() -> None:
    """Megatron's per-layer count with flash attention drops the s^2 softmax and dropout terms."""
    from framework.plan.activations import korthikanti_layer_bytes
    from framework.plan.memory import layer_bytes

    cfg = model_config("llama2-7b")
    lay = Layout(tp=2, dp=4, micro_batch=1)
    for kernel in ("flash", "math"):
        work = Workload(cfg, 4096, 64, kernel=kernel, activations="korthikanti")  # type: ignore[arg-type]
        want = korthikanti_layer_bytes(4096, 1, cfg.hidden, cfg.n_heads, tp=2, sp=True, flash=kernel == "flash")
        assert layer_bytes(work, lay, "none") == want
    assert korthikanti_layer_bytes(4096, 1, 4096, 32, tp=2, sp=True, flash=True) < \
        korthikanti_layer_bytes(4096, 1, 4096, 32, tp=2, sp=True, flash=False)
