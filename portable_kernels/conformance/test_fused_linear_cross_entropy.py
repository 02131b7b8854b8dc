"""Conformance of ``fused_linear_cross_entropy(hidden, weight, target, bias, ...)``: every
variant, dtype and shape below, forward (the fp32 loss) and backward (dhidden, dweight,
dbias), against the projection and torch's ``F.cross_entropy`` in float64. Shapes are
"TxHxV"; calls of fewer than ``MIN_CHUNK_ROWS`` (64) tokens run in one chunk, the
``chunks_`` shapes in several (``chunk_rows``)."""
from __future__ import annotations

import torch

from portable_kernels.conformance.harness import Inputs, KernelSuite, Shape, randn
from portable_kernels.conformance.test_cross_entropy import make_target


def make_inputs(shape, dtype, device, gen) -> Inputs:
    rows, width, n_classes = shape["size"]
    hidden = randn((rows, width), dtype, device, gen, layout=shape.get("layout", "contiguous"))
    weight = randn((n_classes, width), dtype, device, gen, scale=2.0 / width ** 0.5,
                   layout=shape.get("w_layout", "contiguous"))
    bias = randn((n_classes,), dtype, device, gen, scale=0.5) if shape.get("bias") else None
    target = make_target({**shape.params, "size": (rows, n_classes)}, device, gen)
    kwargs = {k: shape[k] for k in ("ignore_index", "label_smoothing", "z_loss", "softcap", "reduction")
              if shape.get(k) is not None}
    return Inputs((hidden, weight, target, bias), kwargs)


ALL = {"label_smoothing": 0.1, "z_loss": 1e-3, "softcap": 15.0}

SUITE = KernelSuite(
    kernel="fused_linear_cross_entropy",
    make_inputs=make_inputs,
    # The logits are a matmul's output in the inputs' dtype before the loss.
    tolerance="dot",
    grad_args=(0, 1, 3),
    arg_names=("hidden", "weight", "target", "bias"),
    out_dtype=lambda dtype: torch.float32,
    shapes=(
        Shape("12x32x100", size=(12, 32, 100), ignored=0.2, quick=True),
        Shape("chunks_300x16x1100", size=(300, 16, 1100), bias=True, ignored=0.2,
              quick=True),                                                   # 5 chunks of 64
        Shape("7x16x33", size=(7, 16, 33)),                                  # odd sizes
        Shape("one_chunk_6x64x40", size=(6, 64, 40)),                        # V < H: one chunk
        Shape("bias_12x32x100", size=(12, 32, 100), bias=True, quick=True),
        Shape("big_v_2x64x1100", size=(2, 64, 1100), bias=True),             # V over two kernel chunks
        Shape("all_ignored_4x16x50", size=(4, 16, 50), ignored=1.0),         # mean over none: NaN
        Shape("smoothing_12x32x100", size=(12, 32, 100), label_smoothing=0.2),
        Shape("z_loss_12x32x100", size=(12, 32, 100), z_loss=1e-2),
        Shape("softcap_12x32x100", size=(12, 32, 100), softcap=3.0),
        Shape("all_13x32x100", size=(13, 32, 100), bias=True, ignored=0.3, quick=True, **ALL),
        Shape("sum_13x32x100", size=(13, 32, 100), bias=True, ignored=0.3, reduction="sum", **ALL),
        Shape("none_13x32x100", size=(13, 32, 100), bias=True, ignored=0.3, reduction="none",
              quick=True, **ALL),
        Shape("int32_9x16x70", size=(9, 16, 70), target=torch.int32, ignored=0.2),
        # Column-major hidden and weight (a transposed view of each): strided operands.
        Shape("transposed_12x32x100", size=(12, 32, 100), layout="transposed",
              w_layout="transposed", quick=True),
        Shape("padded_9x24x50", size=(9, 24, 50), layout="padded", w_layout="gap", bias=True),
        Shape("0x16x20", size=(0, 16, 20), backward=False),
    ),
)


def test_conformance(pk_case):
    """One case; see ``portable_kernels.conformance.harness.CaseRun.check``."""
    pk_case.check()
