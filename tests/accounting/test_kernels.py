"""Kernel groups and the per-step breakdown, on intervals shaped like a profiler trace's."""

from __future__ import annotations

import pytest

from gpuflow.accounting.crosscheck import Interval
from gpuflow.accounting.kernels import group_of, kernel_breakdown, step_flops


@pytest.mark.parametrize(
    "name, group",
    [
        ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNN", "matmul"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"),
        ("triton_tem_fused_flex_attention_0", "attention"),
        ("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64>>", "attention"),
        ("triton_red_fused__to_copy_native_layer_norm_3", "norm"),
        ("triton_poi_fused_add_gelu_7", "elementwise"),
        ("_softmax_grad_rows", "loss"),
        ("_master_adamw_kernel", "optimizer"),
        ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "collective"),
        ("some_library_kernel", "other"),
    ],
)
def test_kernel_names_fall_in_their_groups(name, group):
    assert group_of(name) == group


def test_the_breakdown_adds_up_per_step_with_idle_and_rates():
    # Two steps of 100 µs: a 60 µs product, a 10 µs norm, then 30 µs with nothing running.
    activity = []
    for step in range(2):
        t = 100.0 * step
        activity += [
            Interval(t, t + 60, 7, "kernel", name="nvjet_tst_gemm"),
            Interval(t + 60, t + 70, 7, "kernel", name="triton_per_fused_native_layer_norm_1"),
            Interval(t + 65, t + 66, 7, "h2d", nbytes=8),  # copies are not kernels
        ]
    activity.append(Interval(200, 200, 7, "kernel", name="triton_poi_fused_add_0"))  # the end
    result = kernel_breakdown(activity, steps=2, flops={"matmul": 60e6})
    rows = {r.group: r for r in result.rows}
    assert result.step_us == 100
    assert rows["matmul"].us_per_step == 60 and rows["matmul"].kernels_per_step == 1
    assert rows["matmul"].tflop_per_s == pytest.approx(1.0)  # 60 MFLOP in 60 µs
    assert rows["norm"].us_per_step == 10 and rows["norm"].tflop_per_s is None
    assert rows["idle"].us_per_step == pytest.approx(30)
    assert sum(r.share for r in result.rows) == pytest.approx(1.0)
    assert result.top[0] == ("matmul", "nvjet_tst_gemm", 60)


def test_step_flops_match_the_model_figure():
    from gpuflow.model.gpt import ModelConfig, flops_per_token

    config = ModelConfig(vocab_size=16000, n_layer=6, n_head=6, d_model=384, max_len=128)
    flops = step_flops(384, 6, 128, 16000, tokens=1)
    assert flops["matmul"] + flops["attention"] == flops_per_token(config)
