"""flash_attn_with_kvcache and kv_cache_write: split counts against the float64 reference,
the split heuristic, the in-place append, rows that see nothing, the descriptor (TMA) path
of ``nvidia.hopper`` and its fallbacks to pointer loads, every argument error (before any
launch), the torch operators (opcheck, torch.compile fullgraph), CUDA-graph capture (GPU
only) and the serving benchmark's command line.

Shapes are small and few: every call runs under Triton's interpreter on the CPU (the
conformance suite, portable_kernels/conformance/test_flash_attn_with_kvcache.py, covers
the variants, dtypes and options)."""
from __future__ import annotations

import dataclasses

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton

import portable_kernels as pk
from portable_kernels import ops, plugins
from portable_kernels.testing import assert_close, tolerance

from allocations import Outputs
from conftest import ON_CPU

ROOT = Path(__file__).resolve().parents[1]
NAME = "flash_attn_with_kvcache"


def _family():
    from portable_kernels.kernels import flash_attn_with_kvcache

    return flash_attn_with_kvcache


def _paged(gen, device, dtype=torch.float32, b=3, n_q=1, h=4, h_kv=2, d=64, page=16,
           per_seq=6, lengths=(37, 0, 70), n_new=1):
    """A paged cache: NaN everywhere no sequence holds a key (rows past the lengths, two
    spare blocks), block-table entries past each sequence's blocks naming no block."""
    from portable_kernels.conformance.test_flash_attn_with_kvcache import paged_cache

    *caches, table = paged_cache(lengths[:b], n_new, page, per_seq, h_kv, d, gen)
    q = torch.randn(b, n_q, h, d, generator=gen)
    new = [torch.randn(b, n_new, h_kv, d, generator=gen) for _ in range(2)]
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    k_cache, v_cache = caches
    return [t.to(device, dtype if t.is_floating_point() else t.dtype)
            for t in (q, k_cache, v_cache, *new, seqlens, table)]


# --- split-K -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_split_count_does_not_change_the_result(gen, device, dtype):
    """1, 2, 3 and 7 splits (7 > the blocks of the shorter sequences: empty splits) with a
    sink, which must enter the merge exactly once: each against the float64 reference."""
    q, kc, vc, k, v, seqlens, table = _paged(gen, device, dtype, n_q=2, n_new=2)
    sinks = torch.randn(4, generator=gen).to(device)
    ref, ref_lse = _family().reference(q, kc.clone(), vc.clone(), k, v, seqlens, table,
                                       causal=True, sinks=sinks, return_lse=True)
    tol = tolerance(dtype, "attention")
    for splits in (1, 2, 3, 7):
        out, lse = ops.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), k, v, seqlens, table,
                                               causal=True, sinks=sinks, num_splits=splits,
                                               return_lse=True)
        assert out.dtype == dtype and lse.dtype == torch.float32
        assert_close(out, ref, tol, f"output, {splits} splits")
        assert_close(lse, ref_lse, tolerance(torch.float32, "attention"), f"LSE, {splits} splits")


def test_split_scratch_is_one_allocation_and_lse_only_when_asked(gen, device):
    """A split decode allocates its fp32 partial outputs and LSEs as one tensor, and no LSE
    unless ``return_lse``: each allocation is host time in a decode step. The outputs with
    and without the LSE are the same bits."""
    q, kc, vc, k, v, seqlens, table = _paged(gen, device, torch.float16, n_q=2, n_new=2)

    def call(return_lse):  # the handle: a custom op hides its body's allocations from a mode
        return pk.get_kernel(NAME)(q, kc.clone(), vc.clone(), k, v, seqlens, table,
                                   causal=True, num_splits=3, return_lse=return_lse)

    want, _ = call(True)  # compiles outside the count
    with Outputs() as seen:
        got = call(False)
    assert seen.new(torch.float32) == 1
    with Outputs() as seen:
        call(True)
    assert seen.new(torch.float32) == 2  # the check can fail: the LSE is one more
    assert torch.equal(got, want)


def test_split_heuristic_fills_the_device_from_shapes_only():
    pick = _family().pick_splits
    # Decode on 132 SMs, B=1, H_kv=8: 8 programs a split; two waves need 33 splits.
    assert pick(programs=8, key_blocks=1024, num_sms=132) == 33
    # Never more splits than key blocks, nor than MAX_SPLITS; at least one.
    assert pick(programs=8, key_blocks=4, num_sms=132) == 4
    assert pick(programs=1, key_blocks=10**6, num_sms=10**4) == _family().MAX_SPLITS
    assert pick(programs=512, key_blocks=1024, num_sms=132) == 1
    assert pick(programs=3, key_blocks=0, num_sms=2) == 1


def test_split_count_comes_from_shapes_not_lengths(gen, device, monkeypatch):
    """The grid a call launches depends on the capacity, never on cache_seqlens' values
    (a captured CUDA graph replays it for any lengths): the plan memoises it by shapes, so
    the second call's lengths do not even reach the choice."""
    fam = _family()
    seen = []
    real = fam.pick_splits
    monkeypatch.setattr(fam, "pick_splits", lambda *a: seen.append(a) or real(*a))
    plugins.host().clear_caches()  # plans (and their memos) of earlier tests' shapes
    q, kc, vc, _, _, seqlens, table = _paged(gen, device, n_new=0)
    for lengths in ((37, 0, 70), (1, 0, 1)):
        seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
        ops.flash_attn_with_kvcache(q, kc, vc, None, None, seqlens, table)
    assert len(seen) == 1  # the second call's lengths reused the first's grid


# --- paged gathers --------------------------------------------------------------------------

def _with_config(plan, **kwargs):
    """``plan`` with its first config's keys ``kwargs`` replaced."""
    from portable_kernels.launch import LaunchPlan

    cfg = plan.config
    return LaunchPlan(plan.variant, plan.device,
                      [triton.Config({**cfg.kwargs, **kwargs}, num_warps=cfg.num_warps,
                                     num_stages=cfg.num_stages)], plan.switches)


@pytest.mark.parametrize("page", [16, 64], ids=["page16", "page64"])
@pytest.mark.parametrize("splits", [1, 3], ids=["1split", "3splits"])
@pytest.mark.parametrize("ahead", [1, 0], ids=["table_ahead", "table_in_step"])
def test_paged_gathers_across_pages_and_steps(gen, device, ahead, splits, page):
    """32-key steps over 16-key pages (a step gathers two) and over 64-key pages (two steps
    share one), a shuffled block table, lengths ending mid-page and mid-step, several steps
    per split (with TABLE_AHEAD the next step's table entries are carried across steps;
    without it each step loads its own), NaN wherever no key is and table entries past each
    sequence's blocks naming no block: against the float64 reference."""
    fam = _family()
    q, kc, vc, k, v, seqlens, table = _paged(gen, device, b=3, h=4, h_kv=2, d=32, page=page,
                                             per_seq=192 // page, lengths=(150, 7, 181))
    plan = _with_config(pk.get_kernel(NAME).plan(q, kc, vc, k, v, seqlens, table),
                        BLOCK_N=32, TABLE_AHEAD=ahead)
    ref, ref_lse = fam.reference(q, kc.clone(), vc.clone(), k, v, seqlens, table, causal=True,
                                 return_lse=True)
    out, lse = fam.launch(plan, q, kc.clone(), vc.clone(), k, v, seqlens, table, causal=True,
                          num_splits=splits, return_lse=True)
    assert not out.isnan().any() and not lse.isnan().any()
    assert_close(out, ref, tolerance(torch.float32, "attention"), "output")
    assert_close(lse, ref_lse, tolerance(torch.float32, "attention"), "LSE")


def test_stages_fit_the_devices_shared_memory():
    """num_stages comes down (not below 2) where the config's K/V buffers would pass the
    device's shared memory: D = 256 on a 99 KB sm_89, fp32 D = 256 on an H200; otherwise
    the config's own."""
    from portable_kernels.launch import LaunchPlan

    fam = _family()
    host = plugins.host()
    variant = host.registry.variants[NAME]["generic"]
    cfg = triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=3)
    for profile, d, itemsize, stages in (("l40s", 128, 2, 3), ("l40s", 256, 2, 2),
                                         ("h200", 256, 2, 3), ("h200", 256, 4, 2)):
        plan = LaunchPlan(variant, host.emulation_profile(profile), [cfg], variant.switches)
        assert fam._stages(plan, 16, 64, d, itemsize) == stages, (profile, d, itemsize)



def test_key_blocks_fit_the_devices_shared_memory():
    """BLOCK_N halves (not below 16) where two stages of K/V tiles, a buffer each, would
    pass the device's shared memory (fp32 D = 256 on MI300X's 64 KB and MI355X's 160 KB,
    which failed to compile at 64 keys); otherwise the config's own, and on the CPU always."""
    from portable_kernels.launch import LaunchPlan

    fam = _family()
    host = plugins.host()
    variant = host.registry.variants[NAME]["generic"]
    cfg = triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=2)
    for profile, d, itemsize, block_n in (("mi300x", 256, 4, 16), ("mi355x", 256, 4, 32),
                                          ("mi300x", 64, 2, 64), ("h200", 256, 4, 32), ("h200", 256, 2, 64),
                                          ("h200", 128, 2, 64), ("l40s", 256, 4, 16)):
        plan = LaunchPlan(variant, host.emulation_profile(profile), [cfg], variant.switches)
        assert fam._fit_keys(plan, 16, 64, d, itemsize) == block_n, (profile, d, itemsize)
    unknown = dataclasses.replace(host.emulation_profile("mi300x"), shared_memory=0)  # the CPU's
    assert fam._fit_keys(LaunchPlan(variant, unknown, [cfg], variant.switches), 16, 64, 256, 4) == 64

# --- semantics -----------------------------------------------------------------------------

def test_append_writes_the_cache_in_place_and_attends_to_it(gen, device):
    """Contiguous: the new tokens land at cache_seqlens[b] ...; the other rows stay as they
    were (NaN past the lengths); cache_seqlens itself is not advanced (as FlashAttention)."""
    b, n_max, h, h_kv, d = 2, 40, 2, 1, 32
    lengths = torch.tensor([5, 30], dtype=torch.int32, device=device)
    kc = torch.full((b, n_max, h_kv, d), float("nan"), device=device)
    vc = kc.clone()
    for i, n in enumerate(lengths.tolist()):
        kc[i, :n] = torch.randn(n, h_kv, d, generator=gen).to(device)
        vc[i, :n] = torch.randn(n, h_kv, d, generator=gen).to(device)
    q = torch.randn(b, 3, h, d, generator=gen).to(device)
    k, v = (torch.randn(b, 3, h_kv, d, generator=gen).to(device) for _ in range(2))
    before_k, before_v = kc.clone(), vc.clone()
    out = ops.flash_attn_with_kvcache(q, kc, vc, k, v, lengths, causal=True)
    for i, n in enumerate(lengths.tolist()):
        assert torch.equal(kc[i, n:n + 3], k[i]) and torch.equal(vc[i, n:n + 3], v[i])
        assert torch.equal(kc[i, :n], before_k[i, :n])
        assert kc[i, n + 3:].isnan().all() and vc[i, n + 3:].isnan().all()
    assert lengths.tolist() == [5, 30]
    ref = _family().reference(q, before_k, before_v, k, v, lengths, causal=True)
    assert_close(out, ref, tolerance(torch.float32, "attention"))


def test_rows_that_see_no_key_are_zero_with_lse_minus_inf(gen, device):
    """A sequence with no keys, and causal queries before the first key (Nq > Nk): zeros,
    LSE -inf, no NaN; with sinks the LSE is the sink's logit."""
    b, h, d = 2, 2, 16
    kc = torch.randn(b, 16, 1, d, generator=gen).to(device)
    vc = torch.randn(b, 16, 1, d, generator=gen).to(device)
    q = torch.randn(b, 4, h, d, generator=gen).to(device)
    lengths = torch.tensor([0, 2], dtype=torch.int32, device=device)
    out, lse = ops.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lengths, causal=True,
                                           return_lse=True)
    assert not out.isnan().any()
    assert (out[0] == 0).all() and (lse[0] == float("-inf")).all()
    # Sequence 1 has 2 keys for 4 queries: queries 0 and 1 see none.
    assert (out[1, :2] == 0).all() and (lse[1, :, :2] == float("-inf")).all()
    assert torch.isfinite(lse[1, :, 2:]).all()
    sinks = torch.tensor([0.5, -1.0], device=device)
    _, lse = ops.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lengths, causal=True,
                                         sinks=sinks, return_lse=True)
    assert torch.equal(lse[0], sinks[:, None].expand(h, 4))


# --- tensor descriptors (TMA): nvidia.hopper, forced -----------------------------------------
# The interpreter executes device-side descriptors (zero-filling rows past their shape like
# the copy engine), so the CPU runs the descriptor path too.

HOPPER = "nvidia.hopper"


def _skip_unless_hopper_runs(device) -> None:
    if HOPPER not in pk.list_variants(NAME, device):
        verdict = next(v for v in pk.explain(NAME, device=device).verdicts if v.name == HOPPER)
        pytest.skip(f"{HOPPER}: {verdict.reason}")


@pytest.fixture
def launches(monkeypatch):
    """What the attention kernel's launches got: ``(TMA, PAGE, scratch lent)`` per launch,
    the switch and page size as passed, and whether descriptor scratch was lent during it."""
    from portable_kernels.kernels import _host

    fam = _family()
    seen, lent = [], [0]  # lent[0]: scratch allocators entered and not yet left
    real_launcher, real_scratch = _host.launcher, _host.scratch_allocator

    class Scratch(real_scratch):
        __slots__ = ()

        def __enter__(self):
            lent[0] += 1
            return super().__enter__()

        def __exit__(self, *exc):
            lent[0] -= 1
            return super().__exit__(*exc)

    def launcher(plan, kernel):
        launch = real_launcher(plan, kernel)
        if kernel is not fam._flash_attn_with_kvcache_kernel:
            return launch

        class Grid:
            def __getitem__(self, grid):
                def call(*args, **kwargs):
                    seen.append((kwargs["TMA"], kwargs["PAGE"], lent[0] > 0))
                    return launch[grid](*args, **kwargs)
                return call
        return Grid()

    monkeypatch.setattr(_host, "launcher", launcher)
    monkeypatch.setattr(_host, "scratch_allocator", Scratch)
    return seen


def _contiguous(gen, device, dtype, b=3, n_q=2, h=8, h_kv=2, d=64, capacity=72,
                lengths=(37, 0, 61), n_new=2):
    """A contiguous cache: NaN in every row past a sequence's keys."""
    caches = []
    for _ in range(2):
        cache = torch.full((b, capacity, h_kv, d), float("nan"))
        for i, n in enumerate(lengths):
            cache[i, :n] = torch.randn(n, h_kv, d, generator=gen)
        caches.append(cache)
    q = torch.randn(b, n_q, h, d, generator=gen)
    new = [torch.randn(b, n_new, h_kv, d, generator=gen) for _ in range(2)]
    return [t.to(device, dtype) for t in (q, *caches, *new)]


def _forced(*args, **kwargs):
    with pk.use_variant(**{NAME: HOPPER}):
        return pk.get_kernel(NAME)(*args, **kwargs)


@pytest.mark.parametrize("splits", [1, 3], ids=["1split", "3splits"])
@pytest.mark.parametrize("seqlens", ["tensor", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_descriptors_read_a_contiguous_cache(gen, device, dtype, seqlens, splits, launches):
    """nvidia.hopper's K/V tiles through descriptors: GQA (group 4), key counts that end
    mid-block (32-key steps: 39, 2 and 63 keys after a 2-token append; a 45-key capacity
    without cache_seqlens), a split left with no block (3 splits of 2 blocks), bottom-right
    causal. Rows past each sequence are NaN and the next sequence's rows follow each
    matrix: the descriptor's shape stops at Nk, so neither reaches the output."""
    _skip_unless_hopper_runs(device)
    fam = _family()
    if seqlens == "tensor":
        q, kc, vc, k, v = _contiguous(gen, device, dtype)
        lengths = torch.tensor([37, 0, 61], dtype=torch.int32, device=device)
    else:  # every slot holds a key: nothing to append
        q, kc, vc, _, _ = _contiguous(gen, device, dtype, capacity=45, lengths=(45, 45, 45))
        k = v = lengths = None
    ref, ref_lse = fam.reference(q, kc.clone(), vc.clone(), k, v, lengths, causal=True,
                                 return_lse=True)
    out, lse = _forced(q, kc.clone(), vc.clone(), k, v, lengths, causal=True, num_splits=splits,
                       return_lse=True)
    assert launches == [(True, 0, True)]  # descriptors on a contiguous cache, scratch lent
    assert not out.isnan().any() and not lse.isnan().any()
    assert_close(out, ref, tolerance(dtype, "attention"), "output")
    assert_close(lse, ref_lse, tolerance(torch.float32, "attention"), "LSE")


def test_descriptors_leave_a_paged_cache_to_pointer_loads(gen, device, launches):
    """A paged cache with the TMA switch on: the switch reaches the kernel, which ignores
    it where PAGE > 0 and gathers through the block table with pointer loads (no scratch
    lent), 32-key steps over 16-key pages, NaN wherever no key is; right against the
    reference, one split and three."""
    _skip_unless_hopper_runs(device)
    fam = _family()
    q, kc, vc, k, v, seqlens, table = _paged(gen, device, n_q=2, n_new=2)
    ref = fam.reference(q, kc.clone(), vc.clone(), k, v, seqlens, table, causal=True)
    for splits in (1, 3):
        out = _forced(q, kc.clone(), vc.clone(), k, v, seqlens, table, causal=True,
                      num_splits=splits)
        assert not out.isnan().any()
        assert_close(out, ref, tolerance(torch.float32, "attention"), f"{splits} splits")
    assert launches == [(True, 16, False)] * 2  # the switch as set; the kernel ignores it


def test_descriptors_fall_back_where_no_descriptor_fits(gen, device, launches):
    """A contiguous cache whose base address is off a 16-byte boundary (a view one element
    into its storage): the launcher turns TMA off for the call, and pointer loads read it."""
    _skip_unless_hopper_runs(device)
    fam = _family()
    q, kc, vc, k, v = _contiguous(gen, device, torch.float32)
    kc, vc = (torch.cat([c.new_zeros(1), c.flatten()])[1:].view(c.shape) for c in (kc, vc))
    assert kc.data_ptr() % 16 and not fam._describable(kc, vc)
    lengths = torch.tensor([37, 0, 61], dtype=torch.int32, device=device)
    ref = fam.reference(q, kc.clone(), vc.clone(), k, v, lengths, causal=True)
    out = _forced(q, kc, vc, k, v, lengths, causal=True)
    assert launches == [(False, 0, False)]
    assert_close(out, ref, tolerance(torch.float32, "attention"))


def test_describable_layouts():
    """Unit stride along D and 16-byte aligned base and strides; batch and head strides
    matter only where there are several sequences and several K/V heads."""
    fam = _family()
    ok = torch.zeros(2, 32, 4, 64, dtype=torch.float16)
    assert fam._describable(ok, ok)
    assert not fam._describable(*[torch.zeros(2, 32, 4, 20, dtype=torch.float16)] * 2)  # 40 B rows
    assert fam._describable(*[torch.zeros(2, 32, 4, 20, dtype=torch.float32)] * 2)      # 80 B rows
    strided_d = torch.zeros(2, 32, 4, 128, dtype=torch.float16)[..., ::2]
    assert not fam._describable(strided_d, strided_d)
    # One K/V head of four, sliced: the head stride is 128 B, the row stride 512 B.
    one_head = torch.zeros(2, 32, 4, 64, dtype=torch.float16)[:, :, 1:2]
    assert fam._describable(one_head, one_head)
    # A batch stride of 40 bytes cannot offset a base; with one sequence it offsets nothing.
    odd_batch = torch.zeros(2 * 32 * 64 + 20, dtype=torch.float16).as_strided(
        (2, 32, 1, 64), (20, 64, 64, 1))
    assert not fam._describable(odd_batch, odd_batch)
    assert fam._describable(odd_batch[:1], odd_batch[:1])


def test_descriptor_variant_is_chosen_only_when_forced():
    """nvidia.hopper is not timed yet: on an H100 it is runnable but ranked below generic,
    and use_variant (or PK_VARIANT) picks it."""
    with pk.emulate("h100"):
        chosen = pk.explain(NAME)
        hopper = next(v for v in chosen.verdicts if v.name == HOPPER)
        assert chosen.variant == "generic" and hopper.runnable and hopper.priority < 0
        with pk.use_variant(**{NAME: HOPPER}):
            forced = pk.explain(NAME)
        assert forced.variant == HOPPER and forced.forced


# --- errors, before any launch ------------------------------------------------------------

def _small(device, paged=False, dtype=torch.float32):
    q = torch.randn(2, 1, 4, 32, device=device, dtype=dtype)
    if paged:
        kc = torch.zeros(4, 16, 2, 32, device=device, dtype=dtype)
        table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=device)
    else:
        kc = torch.zeros(2, 32, 2, 32, device=device, dtype=dtype)
        table = None
    return q, kc, kc.clone(), table


def _bad_calls(device):
    q, kc, vc, _ = _small(device)
    qp, kcp, vcp, table = _small(device, paged=True)
    lengths = torch.tensor([3, 4], dtype=torch.int32, device=device)
    new = torch.zeros(2, 1, 2, 32, device=device)
    return [
        ("block_table", pk.DTypeError, (qp, kcp, vcp), {"block_table": table.long()}),
        ("block_table", pk.InputError, (qp, kcp, vcp), {"block_table": table[:1]}),
        ("block_size", pk.InputError, (qp, kcp[:, :8], vcp[:, :8]), {"block_table": table}),
        ("cache_seqlens", pk.InputError, (q, kc, vc, new, new), {"cache_seqlens": 32}),
        ("cache_seqlens=None", pk.InputError, (q, kc, vc, new, new), {}),
        ("cache_seqlens", pk.DTypeError, (q, kc, vc), {"cache_seqlens": lengths.long()}),
        ("cache_seqlens", pk.InputError, (q, kc, vc), {"cache_seqlens": lengths[:1]}),
        ("window_size's left", pk.InputError, (q, kc, vc), {"window_size": (-2, 0)}),
        ("softcap", pk.InputError, (q, kc, vc), {"softcap": -1.0}),
        ("alibi_slopes", pk.InputError, (q, kc, vc),
         {"alibi_slopes": torch.ones(3, device=device)}),
        ("head dim", pk.InputError, (q[..., :16], kc, vc), {}),
        ("multiple of the number of key/value heads", pk.InputError,
         (torch.zeros(2, 1, 3, 32, device=device), kc, vc), {}),
        ("k and v must be given together", pk.ArgumentError, (q, kc, vc, new), {}),
        ("num_splits", pk.InputError, (q, kc, vc), {"num_splits": -1}),
        ("dtypes must match", pk.DTypeError, (q.half(), kc, vc), {}),
        ("batch", pk.InputError, (q, kc, vc, new[:1], new[:1]), {"cache_seqlens": lengths}),
    ]


@pytest.mark.parametrize("index", range(16))
def test_bad_input_is_named_before_any_launch(device, index):
    what, error, args, kwargs = _bad_calls(device)[index]
    caches = [a.clone() for a in args[1:3]]
    with pytest.raises(error, match=what):
        pk.get_kernel(NAME)(*args, **kwargs)
    assert all(torch.equal(a, c) for a, c in zip(args[1:3], caches))  # nothing written


def test_a_call_seen_before_is_not_checked_again(device, monkeypatch):
    """A decode loop repeats one call: its checks run once per signature (shapes, strides,
    dtypes, devices, scalars with their types). A call differing only in a scalar's value
    or type (causal=1 where a bool is due) is checked, and fails."""
    fam = _family()
    q, kc, vc, _ = _small(device)
    lengths = torch.tensor([3, 4], dtype=torch.int32, device=device)
    call = pk.get_kernel(NAME)
    call(q, kc, vc, cache_seqlens=lengths)
    checks = []
    real = fam.check
    monkeypatch.setattr(fam, "check", lambda *a: checks.append(a) or real(*a))
    call(q, kc, vc, cache_seqlens=torch.tensor([5, 6], dtype=torch.int32, device=device))
    assert checks == []  # the same signature: new lengths are values, not checked on the host
    with pytest.raises(pk.ArgumentError, match="causal"):
        call(q, kc, vc, cache_seqlens=lengths, causal=1)
    call(q, kc, vc, cache_seqlens=3)
    with pytest.raises(pk.InputError, match="cache_seqlens"):
        call(q, kc, vc, cache_seqlens=40)  # an int is part of the signature by value
    with pytest.raises(pk.InputError, match="window_size"):
        call(q, kc, vc, cache_seqlens=lengths, window_size=(-2, 0))
    assert len(checks) == 4


def test_value_checks_only_under_pk_check_values(device, monkeypatch):
    """Block-table entries outside the cache and lengths past the capacity need the values
    on the host (a sync): checked under PK_CHECK_VALUES=1 only."""
    q, kc, vc, table = _small(device, paged=True)
    bad_table = table.clone()
    bad_table[1, 0] = 9  # the cache has 4 blocks
    too_long = torch.tensor([3, 40], dtype=torch.int32, device=device)  # capacity 32
    call = pk.get_kernel(NAME)
    monkeypatch.setenv("PK_CHECK_VALUES", "1")
    with pytest.raises(pk.InputError, match=r"block_table\[1\] names block 9"):
        call(q, kc, vc, cache_seqlens=torch.tensor([3, 4], dtype=torch.int32, device=device),
             block_table=bad_table)
    with pytest.raises(pk.InputError, match="cache_seqlens"):
        call(q, kc, vc, cache_seqlens=too_long, block_table=table)
    # Entries past a sequence's blocks are not looked at.
    table[0, 1] = -1
    call(q, kc, vc, cache_seqlens=torch.tensor([3, 20], dtype=torch.int32, device=device),
         block_table=table)


def test_kv_cache_write_errors(device, monkeypatch):
    k = torch.zeros(3, 2, 32, device=device)
    kc = torch.zeros(4, 16, 2, 32, device=device)
    call = pk.get_kernel("kv_cache_write")
    with pytest.raises(pk.DTypeError, match="slot_mapping"):
        call(k, k, kc, kc.clone(), torch.zeros(3, device=device))
    with pytest.raises(pk.InputError, match="slot_mapping must have shape"):
        call(k, k, kc, kc.clone(), torch.zeros(2, dtype=torch.int32, device=device))
    with pytest.raises(pk.InputError, match=r"\(H_kv, D\)"):
        call(k[:, :1], k[:, :1], kc, kc.clone(), torch.zeros(3, dtype=torch.int32, device=device))
    monkeypatch.setenv("PK_CHECK_VALUES", "1")
    with pytest.raises(pk.InputError, match="slot_mapping values"):
        call(k, k, kc, kc.clone(), torch.tensor([0, 64, -1], dtype=torch.int32, device=device))


# --- operators -----------------------------------------------------------------------------

def test_opcheck(gen, device):
    q, kc, vc, k, v, seqlens, table = _paged(gen, device, b=2, h=4, h_kv=2, d=16, per_seq=2,
                                             lengths=(5, 20))
    # opcheck compares the mutated caches without equal_nan: no NaN rows here.
    kc, vc = kc.nan_to_num(), vc.nan_to_num()
    op = torch.ops.portable_kernels
    torch.library.opcheck(op.flash_attn_with_kvcache.default,
                          (q, kc, vc, k, v, seqlens, -1, table, True, None, -1, -1, 0.0, None,
                           None, 2))
    torch.library.opcheck(op.flash_attn_with_kvcache.default,
                          (q, kc[:2], vc[:2], None, None, None, 7))
    slots = torch.tensor([3, -1, 40], dtype=torch.int64, device=device)
    torch.library.opcheck(op.kv_cache_write.default,
                          (k[0].expand(3, 2, 16).contiguous(), v[0].expand(3, 2, 16).contiguous(),
                           kc, vc, slots))


# torch 2.13's own compile stack calls torch.jit.script_method, which it deprecates.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_torch_compile_fullgraph_through_ops_and_handles(gen, device):
    """A decode step (write the token by slot, then attend without appending) compiles
    with no graph break, through the ops and through handles, and matches eager; the cache
    writes happen in the compiled graph too."""
    torch._dynamo.reset()
    q, kc, vc, k, v, seqlens, table = _paged(gen, device, b=2, h=4, h_kv=2, d=16, per_seq=2,
                                             lengths=(5, 20))
    page = kc.shape[1]
    positions = seqlens.long()
    blocks = table[torch.arange(2, device=device), positions // page].long()
    slots = blocks * page + positions % page

    def step(calls, q, kc, vc, k, v):
        calls.kv_cache_write(k[:, 0], v[:, 0], kc, vc, slots)
        return calls.flash_attn_with_kvcache(q, kc, vc, None, None, seqlens + 1, table,
                                             num_splits=2) * 2

    class Handles:
        kv_cache_write = pk.get_kernel("kv_cache_write")
        flash_attn_with_kvcache = pk.get_kernel(NAME)

    kc_e, vc_e = kc.clone(), vc.clone()
    eager = step(ops, q, kc_e, vc_e, k, v)
    for calls in (ops, Handles):
        kc_c, vc_c = kc.clone(), vc.clone()
        compiled = torch.compile(step, fullgraph=True)(calls, q, kc_c, vc_c, k, v)
        assert_close(compiled, eager, tolerance(torch.float32, "attention"))
        assert torch.equal(kc_c.nan_to_num(), kc_e.nan_to_num())
        assert torch.equal(vc_c.nan_to_num(), vc_e.nan_to_num())


@pytest.mark.gpu
@pytest.mark.skipif(ON_CPU, reason="CUDA-graph capture needs a CUDA device (the interpreter "
                    "has no streams or graphs)")
def test_decode_captures_in_a_cuda_graph(gen, device):
    """After one warm call, the decode call (append included) captures; replays with new
    lengths and tokens written into the static inputs give the eager results."""
    dtype = torch.float16
    b, h, h_kv, d, page, per_seq = 3, 8, 2, 128, 16, 8
    q = torch.randn(b, 1, h, d, generator=gen).to(device, dtype)
    kc, vc = (torch.randn(b * per_seq, page, h_kv, d, generator=gen).to(device, dtype)
              for _ in range(2))
    k, v = (torch.randn(b, 1, h_kv, d, generator=gen).to(device, dtype) for _ in range(2))
    table = torch.randperm(b * per_seq, generator=gen).to(device, torch.int32).view(b, per_seq)
    seqlens = torch.tensor([37, 0, 70], dtype=torch.int32, device=device)
    call = pk.get_kernel(NAME)
    call(q, kc.clone(), vc.clone(), k, v, seqlens, table)  # warm: compile, tune, allocate
    static_kc, static_vc = kc.clone(), vc.clone()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        call(q, kc.clone(), vc.clone(), k, v, seqlens, table)
    torch.cuda.current_stream(device).wait_stream(stream)
    with torch.cuda.graph(graph, stream=stream):
        static_out = call(q, static_kc, static_vc, k, v, seqlens, table)
    for lengths in ((40, 3, 71), (1, 0, 100)):
        seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        q.copy_(torch.randn(q.shape, generator=gen).to(device, dtype))
        static_kc.copy_(kc)
        static_vc.copy_(vc)
        graph.replay()
        torch.cuda.synchronize(device)
        eager_kc, eager_vc = kc.clone(), vc.clone()
        eager = call(q, eager_kc, eager_vc, k, v, seqlens, table)
        assert torch.equal(static_out, eager)
        assert torch.equal(static_kc.nan_to_num(), eager_kc.nan_to_num())


# --- the serving benchmark -----------------------------------------------------------------

def test_serving_benchmark_parses_its_command_line():
    """bench/serving_attention.py needs a GPU to run; its options at least parse."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "serving_attention.py"), "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--batches" in proc.stdout and "--keys" in proc.stdout
