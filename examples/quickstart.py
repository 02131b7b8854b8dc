"""Run each kernel once on this machine's device and compare it with torch.

    python examples/quickstart.py            # the current GPU, else the CPU interpreter
    PK_EMULATE=bi150 python examples/quickstart.py   # see what an Iluvatar BI-V150 would pick
"""
from __future__ import annotations

import portable_kernels as pk  # first: it turns Triton's interpreter on where there is no GPU

import torch


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    info = pk.device_info(device)
    print(f"device: {info.name} ({info.vendor} {info.arch}); kernels: {', '.join(pk.list_kernels())}")
    x = torch.randn(64, 1000, device=device)
    y = torch.randn(64, 1000, device=device)
    cases = {
        "vector_add": ((x, y), x + y),
        "softmax": ((x,), torch.softmax(x, -1)),
    }
    for name, (args, expected) in cases.items():
        out = pk.get_kernel(name)(*args)
        err = (out - expected).abs().max().item()
        sel = pk.explain(name, *args)
        print(f"{name:12s} variant {sel.variant:20s} max |error| vs torch {err:.2e}  ({sel.reason})")
        if err > 1e-4:
            raise SystemExit(f"{name}: error {err} is too large")


if __name__ == "__main__":
    main()
