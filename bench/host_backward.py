"""Host time of one eager flash_attn (or layer_norm) backward call, in pieces, on an NVIDIA GPU.

At short sequences an eager backward call can take longer on the host than its kernels take
on the GPU (docs/performance.md, "Host time per call"). The problem here
is small enough (default 1x2x256x64) that the kernels take no time, so each case's µs per
call is host time: ``--iters`` calls, then one synchronize, median of five
(``host_per_call.py``'s timer). The cases, in an order that rotates between ``--rounds``:

- ``torch.autograd.grad`` through a trivial Python ``autograd.Function`` (its backward
  allocates and launches nothing): what any Python node costs the autograd engine;
- the same grad through torch SDPA's cuDNN backend, and through our ``--variant``;
- ours with the backward stage (``_run_stage``, which the node calls) replaced by a
  no-op: our node's own overhead;
- the backward stage called directly as the node calls it (replayed once seen,
  ``_replay.stage``), on this thread, then on a helper thread (one hand-off per call), next
  to a no-op's hand-off, and ``_backward``'s full path (no replay). The autograd engine
  runs CUDA nodes on a device thread of its own; the pair tells whether our Python costs
  more there;
- ``_backward``'s four allocations, and each of its three launches alone.

``--family layer_norm`` (shape MxN, default 8x4096) times a forward and backward as
``host_per_call.py``'s row does (``torch.autograd.grad`` after a fresh forward), ours against
torch's and a trivial Python Function's, then the pieces: the forward alone with grad, the
grad alone of a kept forward, and our forward and backward stages on this thread and the
backward on a helper thread.

    python bench/host_backward.py [--quick] [--family flash_attn|layer_norm]
        [--shape 1x2x256x64] [--dtype bf16] [--full] [--variant nvidia.hopper]
        [--rounds 3] [--iters 1000] [--json PATH] [--set MODULE.NAME=VALUE ...]
"""
from __future__ import annotations

import portable_kernels as pk  # first: it chooses the interpreter before triton is imported

import math
import queue
import statistics
import threading

import torch

from portable_kernels import _replay
from portable_kernels.kernels import flash_attn as fa

import _common  # bench/, beside this script


class _Trivial(torch.autograd.Function):
    """Saves what our node saves (five tensors); its backward returns what it was given."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v, q, q)
        return q.clone()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        _, k, v, _, _ = ctx.saved_tensors
        return grad, k, v


class Helper:
    """A thread that runs each function handed to it while the caller waits; what the
    function raises is raised to the caller."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self) -> None:
        while True:
            fn = self._jobs.get()
            try:
                fn()
            except BaseException as exc:  # the thread lives on; the caller gets it
                self._done.put(exc)
            else:
                self._done.put(None)

    def __call__(self, fn) -> None:
        self._jobs.put(fn)
        exc = self._done.get()
        if exc is not None:
            raise exc


def rotated(names: list[str], round_: int) -> list[str]:
    """Round ``round_``'s order: rotated by the round, and reversed in odd rounds."""
    k = round_ % len(names)
    order = names[k:] + names[:k]
    return order[::-1] if round_ % 2 else order


def cases(shape, dtype, causal: bool, variant: str, device: str = "cuda") -> dict:
    """name -> a callable without arguments, every one on fresh random inputs. (The tests
    build them on the CPU, without the cuDNN case.)"""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, h, n, d = shape
    scale = 1 / math.sqrt(d)
    q, k, v = (torch.randn(shape, device=device).to(dtype).requires_grad_() for _ in range(3))
    dout = torch.randn(shape, device=device).to(dtype)
    leaves = (q, k, v)

    def grad(out):
        return lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)

    trivial = _Trivial.apply(q, k, v)
    vendor = {}
    if device == "cuda":
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            vendor["cuDNN SDPA, grad"] = grad(torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=causal))
    with pk.use_variant(flash_attn=variant):
        plan = pk.get_kernel("flash_attn").plan(q, k, v, causal=causal)
    ours = fa.launch(plan, q, k, v, causal=causal)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    stages = fa.stages(plan)
    out, lse = stages.forward(plan, qd, kd, vd, causal, scale)

    mods = fa.dense_mods(qd, causal)

    def backward():
        return stages.backward(plan, dout, qd, kd, vd, out, lse, causal, scale)

    def backward_stage():  # as the autograd node calls it
        return fa._run_stage(plan, "backward", mods, dout, qd, kd, vd, out, lse, causal, scale,
                             extra=(True,))

    grads = backward()

    def ours_noop():
        real = fa._run_stage
        fa._run_stage = lambda plan, which, mods, *args, extra=(): (*grads, delta)
        try:
            torch.autograd.grad(ours, leaves, dout, retain_graph=True)
        finally:
            fa._run_stage = real

    helper = Helper()
    setup = fa._backward_setup(plan, fa._block_d(d), q.element_size())
    dkdv_m, dkdv_n, dq_m, dq_n = setup.blocks
    tma = plan.switches["TMA"] and n >= setup.tma_min_seq
    upcast = plan.switches["UPCAST"]
    dq, dk, dv = (torch.empty(shape, device=device, dtype=dtype) for _ in range(3))
    delta = torch.empty_like(lse)
    return {
        "trivial Python Function, grad": grad(trivial),
        **vendor,
        f"{variant}, grad": grad(ours),
        f"{variant}, grad, backward stage a no-op": ours_noop,
        "backward stage on this thread": backward_stage,
        "backward stage on a helper thread": lambda: helper(backward_stage),
        "a no-op on a helper thread": lambda: helper(lambda: None),
        "_backward's full path on this thread": backward,
        "4 allocations": lambda: (torch.empty(shape, device=device, dtype=dtype),
                                  torch.empty(shape, device=device, dtype=dtype),
                                  torch.empty(shape, device=device, dtype=dtype),
                                  torch.empty_like(lse)),
        "preprocess launch": lambda: fa._launch_preprocess(out, dout, delta, dq_m,
                                                          setup.dq_options, plan),
        "dk/dv launch": lambda: fa._launch_dkdv(qd, kd, vd, dout, lse, delta, dk, dv, causal,
                                                scale, dkdv_m, dkdv_n, upcast, tma,
                                                setup.dkdv_options, plan),
        "dq launch": lambda: fa._launch_dq(qd, kd, vd, dout, lse, delta, dq, causal, scale,
                                           dq_m, dq_n, upcast, tma, setup.dq_options, plan),
    }


class _TrivialNorm(torch.autograd.Function):
    """Saves what layer_norm's node saves (four tensors); its backward allocates and
    launches nothing."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w, b, b)
        return x.view_as(x)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        _, w, b, _ = ctx.saved_tensors
        return grad, w, b


def layer_norm_cases(shape, dtype, device: str = "cuda") -> dict:
    """name -> a callable without arguments: layer_norm's forward and backward, whole and
    in pieces (module docstring)."""
    from portable_kernels.kernels import layer_norm as ln

    m, n = shape
    x = torch.randn(m, n, device=device).to(dtype).requires_grad_()
    w, b = (torch.randn(n, device=device).to(dtype).requires_grad_() for _ in range(2))
    dy = torch.randn(m, n, device=device).to(dtype)
    leaves = (x, w, b)
    ours = pk.get_kernel("layer_norm")

    def theirs(x, w, b):
        return torch.nn.functional.layer_norm(x, (n,), w, b)

    def both(fn):
        return lambda: torch.autograd.grad(fn(*leaves), leaves, dy)

    def grad_of(out):
        return lambda: torch.autograd.grad(out, leaves, dy, retain_graph=True)

    plan = ours.plan(x, w, b)
    xd, wd, bd = x.detach(), w.detach(), b.detach()
    _, rows, mean, rstd = ln._forward(plan, xd, wd, bd, 1e-5)

    def forward_stage():
        return _replay.stage(plan, ln._forward, (), xd, wd, bd, 1e-5)

    def backward_stage():
        return _replay.stage(plan, ln._backward, (), dy, rows, wd, mean, rstd)

    helper = Helper()
    return {
        "trivial Python Function, forward and grad": both(_TrivialNorm.apply),
        "torch, forward and grad": both(theirs),
        "ours, forward and grad": both(ours),
        "torch, forward with grad": lambda: theirs(*leaves),
        "ours, forward with grad": lambda: ours(*leaves),
        "torch, grad of a kept forward": grad_of(theirs(*leaves)),
        "ours, grad of a kept forward": grad_of(ours(*leaves)),
        "forward stage on this thread": forward_stage,
        "backward stage on this thread": backward_stage,
        "backward stage on a helper thread": lambda: helper(backward_stage),
        "a no-op on a helper thread": lambda: helper(lambda: None),
    }


def main() -> None:
    parser = _common.options(__doc__.split("\n\n")[0], "one round of 100 calls per piece",
                             vendor=False)
    parser.add_argument("--family", default="flash_attn", choices=("flash_attn", "layer_norm"))
    parser.add_argument("--shape", default=None,
                        help="BxHxNxD (default: 1x2x256x64), or MxN for layer_norm (8x4096)")
    parser.add_argument("--dtype", default="bf16", help="fp16 or bf16 (default: bf16)")
    parser.add_argument("--full", action="store_true", help="full attention (default: causal)")
    parser.add_argument("--variant", default="nvidia.hopper")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=1000)
    args = parser.parse_args()
    settings = _common.apply_settings(args.set)
    _common.no_plots("bench/host_backward.py", args.plot)
    if args.quick:
        args.rounds, args.iters = 1, 100
    info = _common.nvidia_gpu("bench/host_backward.py", "our backward's host time against cuDNN's",
                       "tests/test_flash_attn.py")
    if args.shape is None:
        args.shape = "8x4096" if args.family == "layer_norm" else "1x2x256x64"
    shape = tuple(int(x) for x in args.shape.split("x"))
    dtype = _common.dtypes(args.dtype)[0]
    if args.family == "layer_norm":
        table = layer_norm_cases(shape, dtype)
    else:
        table = cases(shape, dtype, not args.full, args.variant)
    names = list(table)
    timings: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in rotated(names, r):
            timings[name].append(_common.per_call_us(table[name], args.iters))
    what = f"{args.family} {args.shape} {dtype}"
    if args.family == "flash_attn":
        what += " full" if args.full else " causal"
    print(f"# host µs per call, {what}, "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.rounds} rounds "
          f"(rotating order), {args.iters} calls then one synchronize, median of 5")
    width = max(map(len, names))
    rows = []
    for name in names:
        row = "  ".join(f"{t:7.1f}" for t in timings[name])
        print(f"{name:{width}s}  {row}   median {statistics.median(timings[name]):7.1f}")
        rows.append({"piece": name, "us": timings[name], "median_us": statistics.median(timings[name])})
    _common.write(args.json, rows, {**_common.meta(info, False), "args": vars(args),
                                    "settings": settings},
                  lambda rows_: "| piece | median µs |\n|:--|--:|\n" + "".join(
                      f"| {r['piece']} | {r['median_us']:.1f} |\n" for r in rows_))


if __name__ == "__main__":
    main()
