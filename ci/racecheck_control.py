"""Minimal warp-specialized Gluon kernels, for telling racecheck's reports on our Gluon kernels
apart from what it says about Triton's own partition dispatch.

``compute-sanitizer --tool racecheck`` reports RAW hazards in all three Gluon kernels, on the
shared bytes through which Triton 3.6 hands each worker warp its partition number
(docs/conformance.md). These controls keep the partitions trivial (each thread writes its
own words; no shared memory is passed between partitions) and vary what might matter: the
workers' warp counts, padding warps (Triton rounds the CTA up to whole warpgroups: 4 + 4 + 1
warps run as 12), shared memory the partitions use on their own (``--smem``), and
partitions of unequal length (``--spin``).

    compute-sanitizer --tool racecheck --racecheck-report hazard \\
        python3 ci/racecheck_control.py --workers 4,1 [--smem] [--spin 2000]

On the H200 (compute-sanitizer 2025.3.1) racecheck reported the same hazard as
in our kernels (the default warps' exit code, read by a worker's dispatch) exactly when some
warps had passed a barrier of their own partition (``--smem``: ``bar.sync 0, 128`` in the
4 default warps) that others had not (a 1-warp worker, padding warps): with ``--workers 1``,
``1,1`` and ``4,1``; not with ``4`` or ``4,4`` (every warp in a 4-warp partition with its
own barrier), and never without ``--smem``. ``ci/racecheck_named_barriers.cu`` shows the
same report on a correctly ordered CUDA program without Triton, so it is how racecheck
pairs barrier instances, not a race.

Each run checks its output (every thread of every partition wrote), so a control that
computed wrong fails without the sanitizer too. It needs an sm_90 GPU and Triton 3.6's
Gluon; ``tests/test_ci_racecheck.py`` compiles it for sm_90 on any machine.
"""
from __future__ import annotations

import argparse

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

PROGRAMS = 264  # two per SM of an H200: programs of one SM overlap
DEFAULT_WARPS = 4


@gluon.jit
def _part(out, buf, zero, SLOT: gl.constexpr, WARPS: gl.constexpr, ROW: gl.constexpr,
          SPIN: gl.constexpr, SMEM: gl.constexpr):
    """Each of the partition's threads writes ``SLOT + 1`` into its own word of the
    program's ``SLOT`` row (``ROW`` words), after ``SPIN`` trips of a loop that adds
    ``zero`` (a runtime 0, so the compiler keeps the loop); with ``SMEM`` the value goes
    through the partition's own shared words first (each thread its own)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    offs = gl.arange(0, 32 * WARPS, layout=layout)
    val = gl.full([32 * WARPS], SLOT + 1, gl.int32, layout)
    acc = gl.zeros([32 * WARPS], gl.int32, layout)
    for i in range(SPIN):
        acc = acc * 3 + zero * (offs + i)
    val = val + acc
    if SMEM:
        mine = buf.index(SLOT).slice(0, 32 * WARPS)
        mine.store(val)
        val = mine.load(layout)
    gl.store(out + (gl.program_id(0) * 3 + SLOT) * ROW + offs, val)


@gluon.jit
def _one_worker(out, zero, W0: gl.constexpr, R0: gl.constexpr, ROW: gl.constexpr,
                SPIN: gl.constexpr, SMEM: gl.constexpr):
    layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    buf = gl.allocate_shared_memory(gl.int32, [3, ROW], layout)
    gl.warp_specialize([
        (_part, (out, buf, zero, 0, ROW // 32, ROW, SPIN, SMEM)),
        (_part, (out, buf, zero, 1, W0, ROW, 0, SMEM)),
    ], [W0], [R0])


@gluon.jit
def _two_workers(out, zero, W0: gl.constexpr, W1: gl.constexpr, R0: gl.constexpr,
                 R1: gl.constexpr, ROW: gl.constexpr, SPIN: gl.constexpr, SMEM: gl.constexpr):
    layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    buf = gl.allocate_shared_memory(gl.int32, [3, ROW], layout)
    gl.warp_specialize([
        (_part, (out, buf, zero, 0, ROW // 32, ROW, SPIN, SMEM)),
        (_part, (out, buf, zero, 1, W0, ROW, 0, SMEM)),
        (_part, (out, buf, zero, 2, W1, ROW, 0, SMEM)),
    ], [W0, W1], [R0, R1])


def launch(out: torch.Tensor, workers: tuple[int, ...], spin: int, smem: bool) -> None:
    """Launches the control with ``workers`` (each 1 or 4 warps) on ``out``, int32
    (PROGRAMS, 3, 32 * DEFAULT_WARPS)."""
    regs = [24 if w == 1 else 80 for w in workers]  # below the launch's share: never waits
    rows = 32 * DEFAULT_WARPS
    if len(workers) == 1:
        _one_worker[(PROGRAMS,)](out, 0, workers[0], regs[0], rows, spin, smem,
                                 num_warps=DEFAULT_WARPS)
    else:
        _two_workers[(PROGRAMS,)](out, 0, workers[0], workers[1], regs[0], regs[1], rows,
                                  spin, smem, num_warps=DEFAULT_WARPS)


def run(workers: tuple[int, ...], spin: int, smem: bool) -> None:
    """Launches the control and checks that every partition's threads wrote their slot."""
    out = torch.full((PROGRAMS, 3, 32 * DEFAULT_WARPS), -1, dtype=torch.int32, device="cuda")
    launch(out, workers, spin, smem)
    torch.cuda.synchronize()
    for slot, warps in enumerate((DEFAULT_WARPS,) + workers):
        got = out[:, slot, :32 * warps]
        assert (got == slot + 1).all(), f"partition {slot} ({warps} warps) wrote {got.unique()}"
    total = DEFAULT_WARPS + sum(workers)
    print(f"racecheck_control: workers {list(workers)}, {total} warps (run as "
          f"{-(-total // 4) * 4}), spin {spin}, smem {smem}: every partition wrote")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="1",
                        help="warps per worker partition, 1 or 4 each, one or two workers")
    parser.add_argument("--spin", type=int, default=0,
                        help="loop trips in the default partition, so it ends last")
    parser.add_argument("--smem", action="store_true",
                        help="partitions pass their values through their own shared words")
    args = parser.parse_args()
    workers = tuple(int(w) for w in args.workers.split(","))
    if not 1 <= len(workers) <= 2 or any(w not in (1, 4) for w in workers):
        parser.error(f"--workers takes one or two counts of 1 or 4, got {args.workers}")
    run(workers, args.spin, args.smem)


if __name__ == "__main__":
    main()
