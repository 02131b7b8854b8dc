"""Conformance of ``cross_entropy(logits, target, ...)``: every variant, dtype and shape
below, forward (the fp32 loss) and backward (dlogits), against torch's own
``F.cross_entropy`` in float64 (softcap and z-loss written out)."""
from __future__ import annotations

import torch

from portable_kernels.conformance.harness import Inputs, KernelSuite, Shape, randn


def make_target(shape, device, gen) -> torch.Tensor:
    """Class ids for ``shape["size"]`` (T, V), a fraction ``shape["ignored"]`` of them
    ``ignore_index``, in ``shape["target"]``'s dtype."""
    rows, n_classes = shape["size"][0], shape["size"][-1]
    ignore_index = shape.get("ignore_index", -100)
    target = torch.randint(n_classes, (rows,), generator=gen)
    target[torch.rand(rows, generator=gen) < shape.get("ignored", 0.0)] = ignore_index
    return target.to(device, shape.get("target", torch.int64))


def make_inputs(shape, dtype, device, gen) -> Inputs:
    logits = randn(shape["size"], dtype, device, gen, layout=shape.get("layout", "contiguous"),
                   scale=shape.get("scale", 3.0))
    kwargs = {k: shape[k] for k in ("ignore_index", "label_smoothing", "z_loss", "softcap", "reduction")
              if shape.get(k) is not None}
    return Inputs((logits, make_target(shape, device, gen)), kwargs)


ALL = {"label_smoothing": 0.1, "z_loss": 1e-3, "softcap": 15.0}

SUITE = KernelSuite(
    kernel="cross_entropy",
    make_inputs=make_inputs,
    tolerance="reduction",
    grad_args=(0,),
    arg_names=("logits", "target"),
    out_dtype=lambda dtype: torch.float32,
    shapes=(
        Shape("7x33", size=(7, 33), quick=True),                         # odd V, one chunk
        Shape("5x2500", size=(5, 2500), quick=True),                     # V over several chunks
        Shape("1x1", size=(1, 1)),                                       # one class: loss 0
        Shape("ignored_9x100", size=(9, 100), ignored=0.4, quick=True),  # some rows ignored
        Shape("all_ignored_4x50", size=(4, 50), ignored=1.0),            # mean over none: NaN, grad 0
        Shape("own_ignore_6x40", size=(6, 40), ignored=0.5, ignore_index=3),  # an in-range ignore id
        Shape("smoothing_6x300", size=(6, 300), label_smoothing=0.2),
        Shape("z_loss_6x300", size=(6, 300), z_loss=1e-2),
        Shape("softcap_6x300", size=(6, 300), softcap=5.0, scale=30.0),  # |x| >> cap: tanh saturates
        Shape("all_8x1500", size=(8, 1500), ignored=0.3, quick=True, **ALL),
        Shape("sum_8x1500", size=(8, 1500), ignored=0.3, reduction="sum", **ALL),
        Shape("none_8x1500", size=(8, 1500), ignored=0.3, reduction="none", quick=True, **ALL),
        Shape("none_7x33", size=(7, 33), reduction="none"),
        Shape("sum_7x33", size=(7, 33), reduction="sum"),
        Shape("int32_10x70", size=(10, 70), target=torch.int32, ignored=0.2),
        Shape("transposed_16x40", size=(16, 40), layout="transposed", ignored=0.2, quick=True),
        Shape("padded_5x70", size=(5, 70), layout="padded", **ALL),      # NaN past each row's end
        Shape("gap_5x70", size=(5, 70), layout="gap"),                   # NaN between elements
        Shape("0x10", size=(0, 10), backward=False),                     # no rows: mean NaN
        Shape("none_0x10", size=(0, 10), reduction="none", backward=False),
    ),
)


def test_conformance(pk_case):
    """One case; see ``portable_kernels.conformance.harness.CaseRun.check``."""
    pk_case.check()
