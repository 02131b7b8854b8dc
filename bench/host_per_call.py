"""Eager calls on small inputs, where the host's launch path, not the GPU, sets the pace:
µs per call of each family, ours as by default on NVIDIA GPUs (direct launches through the
NVIDIA backend's C launcher, see ``portable_kernels/_direct.py``, and replays of seen
signatures, ``portable_kernels/_replay.py``), the same without replays (``PK_REPLAY=0``),
through each binary's Triton launcher (``PK_C_LAUNCHER=0``), through Triton's JIT launch
(``PK_DIRECT_LAUNCH=0``), torch's own operator on the same inputs, and the peer Triton libraries' (FlagGems,
Liger-Kernel: ``bench/_peers.py``) where installed and where they have the call. The rows
are the small calls of a decode loop or a small batch, one or more per family: an add, a
softmax, the norms, gated activations, rotary embedding and asin on 8 rows of 4096, a
16-row matmul against a 4096 x 4096 weight, one decode token over a KV cache and its cache
write, short attention (fixed and variable length), the losses on 8 tokens, dropout, a
grouped product of 8 experts, and two backwards.

One process runs the four settings after an untimed pass of each, alternating over
``--rounds``, each round starting with the next setting. Plans decide on direct
launches when they are built, so each pass sets the variables and drops the plans
(``PluginHost.clear_caches``); the new plans take their tuned configs from the tuning cache
and Triton's compiled kernels from its in-memory cache. (An earlier version ran a process
per setting; this host's speed differed between processes by up to 2x, more than the effect
measured.) Each case times ``--iters`` calls after a warm-up, then synchronizes once, so a
call costs the larger of its host and device time; the median of five such runs
(``_common.per_call_us``). Torch's operator is timed in every pass too, as
a gauge of the host's drift; so are the peers. Inputs are fresh ``torch.randn`` draws. The table gives the
median over rounds, and as "ours / torch" the median over rounds of the default pass's
ratio of the two (timed one after the other, so that drift between passes cancels); the
JSON rows also hold the median of each round's JIT / direct ratio.

    python bench/host_per_call.py [--quick] [--rounds 3] [--iters 2000] [--json PATH]
                                  [--set MODULE.NAME=VALUE ...]

With ``--json PATH``, writes it and the Markdown table beside it after every round. Under
the table, why each family's calls were not replayed, where some were not.
"""
from __future__ import annotations

import portable_kernels as pk  # first: it chooses the interpreter before triton is imported

import contextlib
import itertools
import os
import statistics

import torch

from portable_kernels import _replay, plugins

import _common  # bench/, beside this script
import _peers
import layers

F = torch.nn.functional
#: Each pass's environment: direct launches through the backend's C launcher (the default),
#: through the binary's Triton launcher, and Triton's JIT launch.
SETTINGS = {"direct": {"PK_DIRECT_LAUNCH": "1", "PK_C_LAUNCHER": "1", "PK_REPLAY": "direct"},
            "no_replay": {"PK_DIRECT_LAUNCH": "1", "PK_C_LAUNCHER": "1", "PK_REPLAY": "0"},
            "triton_launcher": {"PK_DIRECT_LAUNCH": "1", "PK_C_LAUNCHER": "0", "PK_REPLAY": "direct"},
            "jit": {"PK_DIRECT_LAUNCH": "0", "PK_C_LAUNCHER": "1", "PK_REPLAY": "direct"}}


def _rand(*shape: int, dtype: torch.dtype = torch.float16, grad: bool = False) -> torch.Tensor:
    return torch.randn(*shape, device="cuda").to(dtype).requires_grad_(grad)


def _backward(fn, leaves, dy):
    def run():
        out = fn(*leaves)
        torch.autograd.grad(out, leaves, dy)
    return run


def _peer(peer: str, family: str, *args):
    """A peer's call of ``family`` on ``args`` (bench/_peers.py's wiring), and the context
    to time it in; None where the peer lacks it or is not installed."""
    impl = _peers.layer(family).get(peer)
    if impl is None:
        return None
    call_args = impl.prepare(args)
    return (lambda: impl.fn(*call_args)), impl.context


def cases() -> dict:
    """name -> {implementation: callable without arguments, or (callable, context to time
    it in)}: ours, torch's and the peers' where they have the call."""
    out = {}
    # Handles made once, as a user holds them (torch's functions are held too).
    add, softmax, layer_norm, rms_norm, matmul = (
        pk.get_kernel(n) for n in ("vector_add", "softmax", "layer_norm", "rms_norm", "matmul"))
    x, y = _rand(4096), _rand(4096)
    out["vector_add 4096 fp16"] = {"ours": lambda: add(x, y),
                                   "torch": lambda: x + y,
                                   "flaggems": _peer("flaggems", "vector_add", x, y)}
    rows = _rand(8, 4096, dtype=torch.bfloat16)
    out["softmax 8x4096 bf16"] = {"ours": lambda: softmax(rows),
                                  "torch": lambda: torch.softmax(rows, -1),
                                  **{p: _peer(p, "softmax", rows) for p in _peers.PEERS}}
    w, bias = _rand(4096, dtype=torch.bfloat16), _rand(4096, dtype=torch.bfloat16)
    out["layer_norm 8x4096 bf16"] = {"ours": lambda: layer_norm(rows, w, bias),
                                     "torch": lambda: F.layer_norm(rows, (4096,), w, bias),
                                     **{p: _peer(p, "layer_norm", rows, w, bias) for p in _peers.PEERS}}
    out["rms_norm 8x4096 bf16"] = {"ours": lambda: rms_norm(rows, w),
                                   "torch": lambda: F.rms_norm(rows, (4096,), w, 1e-6),
                                   **{p: _peer(p, "rms_norm", rows, w) for p in _peers.PEERS}}
    leaves = [_rand(8, 4096, dtype=torch.bfloat16, grad=True), _rand(4096, dtype=torch.bfloat16, grad=True),
              _rand(4096, dtype=torch.bfloat16, grad=True)]
    dy = _rand(8, 4096, dtype=torch.bfloat16)
    out["layer_norm 8x4096 bf16, forward and backward"] = {
        "ours": _backward(layer_norm, leaves, dy),
        "torch": _backward(lambda t, g, c: F.layer_norm(t, (4096,), g, c), leaves, dy)}
    a, b = _rand(16, 4096, dtype=torch.bfloat16), _rand(4096, 4096, dtype=torch.bfloat16)
    out["matmul 16x4096x4096 bf16"] = {"ours": lambda: matmul(a, b),
                                       "torch": lambda: torch.matmul(a, b)}
    # One decode token of B=8 sequences, 32 query heads over 8 KV heads, 4096 cached keys.
    q1 = _rand(8, 1, 32, 128, dtype=torch.bfloat16)
    kc, vc = (_rand(8, 4096, 8, 128, dtype=torch.bfloat16) for _ in range(2))
    lens = torch.full((8,), 4096, dtype=torch.int32, device="cuda")
    kvcache = pk.get_kernel("flash_attn_with_kvcache")
    qt, kt, vt = q1.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)
    out["flash_attn decode B8 H32/8 4096 keys bf16"] = {
        "ours": lambda: kvcache(q1, kc, vc, cache_seqlens=lens),
        "torch": lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)}
    q, k, v = (_rand(1, 8, 512, 64, grad=True) for _ in range(3))
    attn = pk.get_kernel("flash_attn")
    out["flash_attn 1x8x512x64 causal fp16"] = {
        "ours": lambda: attn(q.detach(), k.detach(), v.detach(), causal=True),
        "torch": lambda: F.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(), is_causal=True)}
    dq = _rand(1, 8, 512, 64)
    out["flash_attn 1x8x512x64 causal fp16, forward and backward"] = {
        "ours": _backward(lambda *t: attn(*t, causal=True), [q, k, v], dq),
        "torch": _backward(lambda *t: F.scaled_dot_product_attention(*t, is_causal=True), [q, k, v], dq)}
    out.update(_other_families())
    return {name: {impl: fn for impl, fn in impls.items() if fn is not None}
            for name, impls in out.items()}


def _other_families() -> dict:
    """The rest of the families, each on a small call against torch's eager equivalent:
    the layers of a model on 8 tokens of 4096 (bench/layers.py's arguments and torch ops),
    the losses on 8 tokens, dropout, a grouped product of 8 experts, a varlen batch of
    four short sequences, and a decode step's cache write."""
    out = {}
    for family in ("add_rms_norm", "swiglu", "geglu", "rope", "asin"):
        args = layers.inputs(family, 8, 4096, torch.bfloat16, "cuda")
        mine, theirs = pk.get_kernel(family), layers.torch_op(family)
        out[f"{family} 8x4096 bf16"] = {
            "ours": lambda mine=mine, args=args: mine(*args),
            "torch": lambda theirs=theirs, args=args: theirs(*args),
            **{p: _peer(p, family, *args) for p in _peers.PEERS}}
    logits = _rand(8, 32000, dtype=torch.bfloat16)
    target = torch.randint(0, 32000, (8,), device="cuda")
    ce = pk.get_kernel("cross_entropy")
    out["cross_entropy 8x32000 bf16"] = {"ours": lambda: ce(logits, target),
                                         "torch": lambda: F.cross_entropy(logits.float(), target)}
    hidden, weight = _rand(8, 4096, dtype=torch.bfloat16), _rand(32000, 4096, dtype=torch.bfloat16)
    flce = pk.get_kernel("fused_linear_cross_entropy")
    out["fused_linear_cross_entropy 8x4096x32000 bf16"] = {
        "ours": lambda: flce(hidden, weight, target),
        "torch": lambda: F.cross_entropy((hidden @ weight.t()).float(), target)}
    x = _rand(4096)
    drop = pk.get_kernel("dropout")
    out["dropout 4096 fp16"] = {"ours": lambda: drop(x, 0.1, 1234),
                                "torch": lambda: F.dropout(x, 0.1, training=True)}
    experts_a = [_rand(16, 1024, dtype=torch.bfloat16) for _ in range(8)]
    experts_b = [_rand(1024, 1024, dtype=torch.bfloat16) for _ in range(8)]
    grouped = pk.get_kernel("grouped_matmul")
    out["grouped_matmul 8x(16x1024x1024) bf16"] = {
        "ours": lambda: grouped(experts_a, experts_b),
        "torch": lambda: [a @ b for a, b in zip(experts_a, experts_b)]}
    lengths = [37, 64, 5, 100]
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")
    total = sum(lengths)
    qv, kv, vv = (_rand(total, 8, 64) for _ in range(3))
    varlen = pk.get_kernel("flash_attn_varlen")
    padded = [t.new_zeros(len(lengths), 8, max(lengths), 64) for t in (qv, kv, vv)]
    out["flash_attn_varlen 4 seqs (206 tokens) H8 D64 causal fp16"] = {
        "ours": lambda: varlen(qv, kv, vv, cu, cu, max(lengths), max(lengths), causal=True),
        # torch has no varlen call: SDPA on the padded batch (the work a user would do).
        "torch": lambda: F.scaled_dot_product_attention(*padded, is_causal=True)}
    k_new, v_new = (_rand(8, 8, 128, dtype=torch.bfloat16) for _ in range(2))
    k_pages, v_pages = (_rand(512, 16, 8, 128, dtype=torch.bfloat16) for _ in range(2))
    slots = torch.randperm(512 * 16, device="cuda")[:8]
    write = pk.get_kernel("kv_cache_write")

    def torch_write():
        k_pages.view(-1, 8, 128)[slots] = k_new
        v_pages.view(-1, 8, 128)[slots] = v_new

    out["kv_cache_write 8 tokens H_kv8 D128 paged bf16"] = {
        "ours": lambda: write(k_new, v_new, k_pages, v_pages, slots), "torch": torch_write}
    return out


def _time(fn, iters: int) -> float:
    call, context = fn if isinstance(fn, tuple) else (fn, contextlib.nullcontext)
    with context():  # FlagGems' use_gems() costs milliseconds to enter: once per loop
        return _common.per_call_us(call, iters)


#: family -> why some of its calls took the full path with replays on (printed under the
#: table: a row whose "ours" and "no replay" columns match is usually one of these).
NOT_REPLAYED: dict[str, set[str]] = {}


def _note_not_replayed() -> None:
    host = plugins.host()
    # Handles' replays, and the autograd stages' (``_replay.stage``: kept on each plan).
    stages = {r.kernel: r for plan in host.launch_plans.values() for r in plan._tuned.values()
              if isinstance(r, _replay.Replays)}
    for family, replays in [*host.replays.items(), *stages.items()]:
        if not replays.active:
            continue
        reasons = {replays.why.get(key, "?") for key, recipe in replays.recipes.items()
                   if recipe is None}
        reasons |= {f"never recorded (seen, {replays.why.get(key, 'no reason kept')})"
                    for key in replays.tries}
        if reasons:
            NOT_REPLAYED.setdefault(family, set()).update(reasons)


def measure(iters: int, env: dict) -> dict:
    """µs per call of every case with the variables ``env``, on plans built afresh. The
    variables and the plans are put back afterwards: plans built under a setting would keep
    it for every later call in the process."""
    before = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    plugins.host().clear_caches()
    try:
        times = {name: {impl: _time(fn, iters) for impl, fn in impls.items()}
                 for name, impls in cases().items()}
        _note_not_replayed()
        return times
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        plugins.host().clear_caches()


def main() -> None:
    parser = _common.options(__doc__, "one round of 200 calls per case", vendor=False)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=2000)
    args = parser.parse_args()
    settings = _common.apply_settings(args.set)
    _common.no_plots("bench/host_per_call.py", args.plot)
    if args.quick:
        args.rounds, args.iters = 1, 200
    info = _common.nvidia_gpu("bench/host_per_call.py", "against torch's operators", "tests/test_direct.py")
    runs: dict[str, list[dict]] = {s: [] for s in SETTINGS}
    # An untimed pass of every setting first: the process's first calls (compiling, tuning,
    # a host still ramping up) ran every case 1.2-1.6x slower, torch's too, and the pass
    # that came first took it all.
    for env in SETTINGS.values():
        measure(max(20, args.iters // 10), env)
    print("warm-up pass done", flush=True)
    order = list(SETTINGS)
    for r in range(args.rounds):
        # Each round starts with the next setting: drift within a round favours none.
        for setting in order[r % len(order):] + order[:r % len(order)]:
            runs[setting].append(measure(args.iters, SETTINGS[setting]))
            print(f"round {r + 1}/{args.rounds}: {setting} done", flush=True)
        # Written after every round: a run cut short (a device call's time limit) keeps the
        # rounds it finished.
        rows, table = _table(runs, r + 1, info)
        _common.write(args.json, rows, {**_common.meta(info, False), "peers": _peers.versions(),
                                        "rounds": r + 1, "iters": args.iters,
                                        "settings": settings, "runs": runs,
                                        "not_replayed": {f: sorted(why) for f, why
                                                         in NOT_REPLAYED.items()}},
                      lambda _: table)
    print(table)
    for family, reasons in sorted(NOT_REPLAYED.items()):
        print(f"not replayed: {family}: {'; '.join(sorted(reasons))}")
    if args.json:
        print(f"wrote {args.json} and its .md")


def _table(runs: dict[str, list[dict]], rounds: int, info) -> tuple[list[dict], str]:
    """The rows (medians over the finished rounds) and their Markdown table."""
    rows = []
    for name in runs["direct"][0]:
        row = {"case": name}
        for setting in SETTINGS:
            row[setting] = statistics.median(run[name]["ours"] for run in runs[setting])
        for impl in ("torch", *_peers.PEERS):
            times = [run[name][impl] for s in SETTINGS for run in runs[s] if impl in run[name]]
            row[impl] = statistics.median(times) if times else None
        row["jit_over_direct"] = statistics.median(
            j[name]["ours"] / d[name]["ours"] for d, j in zip(runs["direct"], runs["jit"]))
        # Ours against torch's operator timed right after it in the same pass: a host that
        # drifts between passes moves both.
        row["ours_over_torch"] = statistics.median(
            run[name]["ours"] / run[name]["torch"] for run in runs["direct"])
        rows.append(row)
    header = (_common.header("eager host time per call", info, False).replace(" · median of do_bench", "")
              + f" · one process, median of {rounds} rounds")
    lines = [header, "", "µs per call (a call costs the larger of its host and device time)", "",
             "| case | ours | ours, no replay | ours, Triton's launcher | ours, JIT launches | torch "
             "| FlagGems | Liger | ours / torch |",
             "|:--|--:|--:|--:|--:|--:|--:|--:|--:|"]

    def fmt(value):
        return "-" if value is None else f"{value:.1f}"

    for r in rows:
        lines.append(f"| {r['case']} | {r['direct']:.1f} | {r['no_replay']:.1f} | "
                     f"{r['triton_launcher']:.1f} | {r['jit']:.1f} | "
                     f"{fmt(r['torch'])} | "
                     f"{fmt(r['flaggems'])} | {fmt(r['liger'])} | {r['ours_over_torch']:.2f} |")
    return rows, "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
