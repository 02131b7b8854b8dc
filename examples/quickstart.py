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
    # label: (kernel, arguments, torch's answer in float32, allowed max |error|)
    cases = {
        "vector_add": ("vector_add", (x, y), x + y, 1e-5),
        "softmax": ("softmax", (x,), torch.softmax(x, -1), 1e-5),
        "layer_norm": ("layer_norm", (x, w, b), torch.nn.functional.layer_norm(x, (1000,), w, b), 1e-3),
        "matmul": ("matmul", (a16, b16), a16.float() @ b16.float(), 5e-2),
        "flash_attn": ("flash_attn", (q, kv, kv), sdpa(q.float(), kv.float().repeat_interleave(2, 1),
                                                       kv.float().repeat_interleave(2, 1)), 1e-2),
    }
    if info.has("fp8"):
        # fp8 operands give a bf16 output; pass an (N, K) weight as w.t(), the layout fp8
        # tensor cores read directly. bf16 keeps 8 significant bits: allow two steps of
        # the largest value.
        a8 = torch.randn(100, 256, device=device).to(torch.float8_e4m3fn)
        w8 = torch.randn(72, 256, device=device).to(torch.float8_e4m3fn)
        ref8 = a8.float() @ w8.float().t()
        cases["matmul fp8"] = ("matmul", (a8, w8.t()), ref8, 2 ** -6 * ref8.abs().max().item())
    for label, (name, args, expected, allowed) in cases.items():
        out = pk.get_kernel(name)(*args)
        err = (out.float() - expected).abs().max().item()
        sel = pk.explain(name, *args)
        print(f"{label:12s} {sel.variant:22s} max |error| vs torch {err:.2e}")
        if not err <= allowed:
            raise SystemExit(f"{label}: error {err} exceeds {allowed}")


if __name__ == "__main__":
    main()
