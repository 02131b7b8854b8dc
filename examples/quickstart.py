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
    w, b = torch.randn(1000, device=device), torch.randn(1000, device=device)
    a16 = torch.randn(100, 200, device=device, dtype=torch.float16)
    b16 = torch.randn(200, 72, device=device, dtype=torch.float16)
    q = torch.randn(1, 4, 100, 64, device=device, dtype=torch.float16)
    kv = torch.randn(1, 2, 130, 64, device=device, dtype=torch.float16)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    # (arguments, torch's answer in float32, allowed max |error|)
    cases = {
        "vector_add": ((x, y), x + y, 1e-5),
        "softmax": ((x,), torch.softmax(x, -1), 1e-5),
        "layer_norm": ((x, w, b), torch.nn.functional.layer_norm(x, (1000,), w, b), 1e-3),
        "matmul": ((a16, b16), a16.float() @ b16.float(), 5e-2),
        "flash_attn": ((q, kv, kv), sdpa(q.float(), kv.float().repeat_interleave(2, 1),
                                         kv.float().repeat_interleave(2, 1)), 1e-2),
    }
    for name, (args, expected, allowed) in cases.items():
        out = pk.get_kernel(name)(*args)
        err = (out.float() - expected).abs().max().item()
        sel = pk.explain(name, *args)
        print(f"{name:12s} {sel.variant:22s} max |error| vs torch {err:.2e}")
        if not err <= allowed:
            raise SystemExit(f"{name}: error {err} exceeds {allowed}")


if __name__ == "__main__":
    main()
