"""What the attention families share beyond the softmax loop: which keys a query sees, and
how a score is changed before its softmax (FlashAttention's options).

Semantics (FlashAttention's, with scores ``s = q·k · sm_scale`` in natural-log units):

- **Alignment.** Query ``i`` and key ``j`` are compared through ``j - i - diag``. ``diag = 0``
  is SDPA's top-left alignment (``flash_attn``'s default); ``diag = Nk - Nq`` the bottom-right
  one of FlashAttention >= 2.1 (query ``i`` of a sequence sees keys up to ``i + Nk - Nq``),
  which decode and chunked prefill need, and which ``flash_attn_varlen`` and
  ``flash_attn_with_kvcache`` always use.
- **Visibility.** Key ``j`` counts for query ``i`` when ``j < Nk`` and
  ``-left <= j - i - diag <= right``. ``window_size=(left, right)`` with ``-1`` for
  unbounded; ``causal`` is ``right = 0`` (a window's right edge is clipped to it).
- **softcap** ``c > 0``: ``s = c · tanh(s / c)``, before masking and ALiBi.
- **ALiBi**: ``s += -slope[h] · |j - i - diag|`` (slopes (H,) or (B, H), fp32).
- **sinks** (H,): one extra logit per head that takes probability mass but adds no value:
  the softmax's denominator gains ``exp(sink[h])``. The log-sum-exp includes it.
- A query that sees no key gets a zero output and an LSE of ``-inf`` (``sink[h]`` with
  sinks), never NaN.

The kernels work in the log2 domain (``s2 = s · log2(e)``, so that ``exp2`` replaces
``exp``). Every option has a log2-domain form with the same shape: ``c · tanh(s / c)``
becomes ``c2 · tanh(s2 / c2)`` with ``c2 = c · log2(e)``; ALiBi's slope and a sink are
multiplied by ``log2(e)``. The host passes them converted.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from . import _host

LOG2E = 1.4426950408889634
#: What an unbounded window edge becomes on the device: far past any sequence, and small
#: enough that ``i + diag ± UNBOUNDED`` stays inside int32.
UNBOUNDED = 1 << 30


# --- device helpers ---------------------------------------------------------------------------

@triton.jit
def tanh(x):
    """``tanh`` from one exp2 (libdevice's does not run under the interpreter):
    ``2 / (1 + e^(-2x)) - 1``. For large negative x the exponential overflows to inf and the
    result is exactly -1; for large positive x it underflows and the result is 1; near 0 the
    subtraction leaves an absolute error of about 1e-7 (what a score can carry). Few
    operations on purpose: on sm_100 a form with an abs, a select and two divisions made
    the warp-specialized 128 x 128 forward spill its score tile past shared memory."""
    return 2.0 / (1.0 + tl.math.exp2(-2.8853900817779268 * x)) - 1.0


@triton.jit
def relative(qi, kj, diag):
    """``j - i - diag`` for broadcastable query and key index tensors (any orientation:
    [M, 1] with [1, N], or [1, M] with [N, 1])."""
    return kj - qi - diag


@triton.jit
def visible(qi, kj, n_k, diag, left, right, CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """Which (query, key) pairs count (module docstring). ``left``/``right`` are the window's
    edges (``UNBOUNDED`` for -1); ``CAUSAL`` alone is the one compare of ``right = 0``."""
    ok = kj < n_k
    if WINDOW:
        rel = relative(qi, kj, diag)
        ok = ok & (rel >= -left) & (rel <= right)
    elif CAUSAL:
        ok = ok & (kj <= qi + diag)
    return ok


@triton.jit
def capped(qk, scale, softcap2):
    """``c2 · tanh(qk · scale / c2)``: the softcap of raw scores ``qk`` whose log2-domain
    value is ``qk · scale``, the scale folded into the tanh's argument (one multiply a
    score, and one value fewer alive: the sm_100 forward's registers are that tight)."""
    return softcap2 * tanh(qk * (scale / softcap2))


@triton.jit
def modify_scores(s2, qi, kj, diag, softcap2, alibi2,
                  SOFTCAP: tl.constexpr, ALIBI: tl.constexpr):
    """Softcap, then ALiBi, of log2-domain scores ``s2`` (module docstring). ``alibi2`` is
    this head's slope times log2(e), broadcastable against ``s2``."""
    if SOFTCAP:
        s2 = capped(s2, 1.0, softcap2)
    if ALIBI:
        s2 = s2 - alibi2 * tl.abs(relative(qi, kj, diag)).to(tl.float32)
    return s2


@triton.jit
def softcap_grad(s2, softcap2, SOFTCAP: tl.constexpr):
    """d(capped)/d(raw) at a capped log2-domain score: ``1 - tanh² = 1 - (s2 / c2)²``."""
    if SOFTCAP:
        t = s2 / softcap2
        g = 1.0 - t * t
    else:
        g = 1.0
    return g


# --- host side --------------------------------------------------------------------------------

class Options(NamedTuple):
    """The checked options of one call, in what the kernels take.

    ``left``/``right``: window edges (``UNBOUNDED`` for none); ``window``: whether any edge is
    bounded beyond what ``causal`` gives; ``softcap2``: the cap in log2 units (0: none);
    ``alibi``: fp32 slopes (B, H) or None; ``sinks``: fp32 (H,) or None."""
    causal: bool
    left: int
    right: int
    window: bool
    softcap2: float
    alibi: Any
    sinks: Any

    @property
    def switches(self) -> dict:
        """The constexpr switches of a kernel that takes these options."""
        return {"CAUSAL": self.causal, "WINDOW": self.window, "SOFTCAP": self.softcap2 > 0,
                "ALIBI": self.alibi is not None, "SINKS": self.sinks is not None}


#: The largest head dim the attention kernels take (tiles are next_power_of_2(D) wide).
MAX_HEAD_DIM = 256


def check_heads(kernel: str, h: int, h_kv: int, d: int, kv_where: str = "") -> None:
    """Grouped-query heads (H a multiple of H_kv) and a head dim the kernels take; errors
    name the counts (``kv_where`` says where H_kv was read, for the message)."""
    if h_kv == 0 or h % h_kv:
        raise _host.InputError(
            f"{kernel}: the number of query heads ({h}) must be a multiple of the number of "
            f"key/value heads ({h_kv}{kv_where})")
    if not 1 <= d <= MAX_HEAD_DIM:
        raise _host.InputError(f"{kernel}: head dim D={d} is not supported (1 to {MAX_HEAD_DIM})")


def check_scale(kernel: str, sm_scale: Any) -> None:
    """``sm_scale`` is a real number or None (1/sqrt(D))."""
    if sm_scale is not None and (isinstance(sm_scale, bool)
                                 or not isinstance(sm_scale, numbers.Real)):
        raise _host.ArgumentError(
            f"{kernel}: sm_scale must be a float or None, got {type(sm_scale).__name__}")


def plain(causal: bool) -> Options:
    """The options of a call that sets none: SDPA's attention, causal or not."""
    return _PLAIN[causal]


def check_options(kernel: str, *, causal: Any, window_size: Any, softcap: Any, alibi_slopes: Any,
                  sinks: Any, batch: int, heads: int, device: torch.device) -> Options:
    """Validate FlashAttention's options, naming the bad argument (before any launch), and
    convert them for the kernels. ``alibi_slopes`` may be (H,) or (B, H); the result is (B, H)
    (an expanded view, no copy). A call that sets none takes a few compares."""
    if (alibi_slopes is None and sinks is None and window_size == (-1, -1)
            and softcap == 0 and softcap is not False and (causal is True or causal is False)):
        return _PLAIN[causal]
    _host.check_bool(kernel, "causal", causal)
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise _host.ArgumentError(f"{kernel}: window_size must be a pair (left, right), got "
                                  f"{window_size!r}") from None
    for side, value in (("left", left), ("right", right)):
        _host.check_int(kernel, f"window_size's {side}", value)
        if value < -1:
            raise _host.InputError(f"{kernel}: window_size's {side} must be >= -1 (-1: "
                                   f"unbounded), got window_size={tuple(window_size)}")
    left, right = int(left), int(right)
    if causal:
        right = 0
    window = left >= 0 or (right >= 0 and not (causal and right == 0))
    left = UNBOUNDED if left < 0 else left
    right = UNBOUNDED if right < 0 else right

    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise _host.ArgumentError(f"{kernel}: softcap must be a float, got {type(softcap).__name__}")
    if not 0.0 <= softcap < math.inf:  # also rejects NaN
        raise _host.InputError(f"{kernel}: softcap must be finite and >= 0 (0: off), got "
                               f"softcap={softcap}")

    alibi = None
    if alibi_slopes is not None:
        _host.check_aux(kernel, "alibi_slopes", alibi_slopes, device, torch.float32)
        if tuple(alibi_slopes.shape) not in ((heads,), (batch, heads)):
            raise _host.InputError(f"{kernel}: alibi_slopes must have shape ({heads},) or "
                                   f"({batch}, {heads}) (heads, or batch x heads), got "
                                   f"{tuple(alibi_slopes.shape)}")
        alibi = alibi_slopes.expand(batch, heads)

    if sinks is not None:
        _host.check_aux(kernel, "sinks", sinks, device)
        if tuple(sinks.shape) != (heads,):
            raise _host.InputError(f"{kernel}: sinks must have shape ({heads},) (one logit per "
                                   f"query head), got {tuple(sinks.shape)}")
    return Options(bool(causal), left, right, window, float(softcap) * LOG2E, alibi, sinks)


_PLAIN = {c: Options(c, UNBOUNDED, 0 if c else UNBOUNDED, False, 0.0, None, None)
          for c in (False, True)}


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              diag: int = 0, window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None,
              sinks=None, sm_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention with every option in float64, written out (the test oracle).

    q (B, H, Nq, D), k/v (B, H_kv, Nk, D) with H % H_kv == 0; ``diag`` the alignment
    (0: top-left, Nk - Nq: bottom-right). Returns ``(out (B, H, Nq, D), lse (B, H, Nq))`` in
    float64 on q's device (the options are moved there: a test may keep its oracle's inputs on
    the CPU and the call's on a GPU), differentiable in q, k, v and sinks; rows that see no
    key give zeros and an LSE of -inf (the sink's logit with sinks)."""
    b, h, n_q, d = q.shape
    h_kv, n_k = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    q64, k64, v64 = q.double(), k.double(), v.double()
    if h_kv != h:
        k64 = k64.repeat_interleave(h // h_kv, dim=1)
        v64 = v64.repeat_interleave(h // h_kv, dim=1)
    s = q64 @ k64.transpose(-1, -2) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    rel = (torch.arange(n_k, device=q.device)[None, :]
           - torch.arange(n_q, device=q.device)[:, None] - diag)
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(q.device, torch.float64).expand(b, h)
        s = s - slopes[:, :, None, None] * rel.abs()
    left, right = window_size
    if causal:
        right = 0
    ok = torch.ones_like(rel, dtype=torch.bool)
    if left >= 0:
        ok &= rel >= -left
    if right >= 0:
        ok &= rel <= right
    s = s.masked_fill(~ok, -math.inf)
    if sinks is not None:
        sink = sinks.to(q.device, torch.float64)[None, :, None, None].expand(b, h, n_q, 1)
        lse = torch.logsumexp(torch.cat([s, sink], dim=-1), dim=-1)
    else:
        lse = torch.logsumexp(s, dim=-1)
    # exp(s - lse) is 0 at hidden keys; rows with no key and no sink have lse = -inf and
    # give zeros. (A NaN score makes its row's lse NaN, and the row NaN, as softmax does.)
    empty = torch.isneginf(lse)
    p = torch.where(empty[..., None], torch.zeros_like(s),
                    torch.exp(s - lse.masked_fill(empty, 0)[..., None]))
    return p @ v64, lse
