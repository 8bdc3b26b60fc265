#!/usr/bin/env python3
"""A plain, per-tensor PyTorch DeMo encoder: the yardstick for `swarm codec encode` (issue 16).

Written from the DeMo paper's description (momentum -> chunked orthonormal DCT-II -> per-chunk
top-k -> decoupling), the way one would write it in PyTorch without tuning: each tensor is cut
into h x w chunks, transformed with two matmuls, its top-k coefficients by magnitude kept (sign
values, int16 indices), their decoded part (scatter + inverse transform) subtracted from the
momentum in place, and the kept entries written out.

    python scripts/demo_reference.py make runs/codec-200m.safetensors          # 200M f32 params
    python scripts/demo_reference.py encode runs/codec-200m.safetensors --output /tmp/ref.bin
    python scripts/demo_reference.py compare --swarm target/release/swarm --input runs/codec-200m.safetensors

`compare` runs both encoders as whole processes on the same file, one after the other, and
prints wall time and peak resident memory (each child's own `ru_maxrss`, from wait4). Run it
with the torch of the project's virtualenv (`~/.cache/swarm/torch-2.11.0/bin/python`), on an
otherwise idle machine.
"""

import argparse
import math
import os
import subprocess
import sys
import time


def dct_basis(n, torch):
    """Orthonormal DCT-II basis as columns: coefficients of a block X are F_h^T X F_w."""
    i = torch.arange(n, dtype=torch.float64).unsqueeze(1)
    k = torch.arange(n, dtype=torch.float64).unsqueeze(0)
    f = torch.cos(math.pi * (2 * i + 1) * k / (2 * n))
    f[:, 0] *= math.sqrt(1.0 / n)
    f[:, 1:] *= math.sqrt(2.0 / n)
    return f.to(torch.float32)


def chunk_len(n, s):
    """The largest divisor of n not above s (the project's chunk rule for awkward sizes)."""
    for c in range(min(n, s), 0, -1):
        if n % c == 0:
            return c
    return 1


def cmd_make(a):
    import torch
    from safetensors.torch import save_file

    # A Llama-like stack: per layer q, k, v, o (d x d) and gate, up (f x d), down (d x f).
    d, f = a.dim, a.ffn
    g = torch.Generator().manual_seed(a.seed)
    tensors = {}
    for layer in range(a.layers):
        for name, shape in [
            ("q", (d, d)), ("k", (d, d)), ("v", (d, d)), ("o", (d, d)),
            ("gate", (f, d)), ("up", (f, d)), ("down", (d, f)),
        ]:
            tensors[f"layers.{layer:02d}.{name}"] = torch.randn(shape, generator=g) * 1e-3
    n = sum(t.numel() for t in tensors.values())
    save_file(tensors, a.path)
    print(f"wrote {a.path}: {len(tensors)} tensors, {n} f32 parameters ({n * 4 / 1e9:.2f} GB)")


def cmd_encode(a):
    import torch
    from safetensors.torch import load_file

    t0 = time.time()
    torch.set_grad_enabled(False)
    tensors = load_file(a.input)
    bases = {}
    out = []
    kept = 0
    for name in sorted(tensors):
        m = tensors[name].float()
        rows = m.shape[0] if m.dim() > 1 else 1
        cols = m.numel() // rows
        h, w = chunk_len(rows, a.chunk), chunk_len(cols, a.chunk)
        for n in (h, w):
            if n not in bases:
                bases[n] = dct_basis(n, torch)
        fh, fw = bases[h], bases[w]
        x = m.reshape(rows // h, h, cols // w, w).permute(0, 2, 1, 3).reshape(-1, h, w)
        coef = (fh.T @ x @ fw).reshape(x.shape[0], h * w)
        k = min(a.topk, h * w)
        idx = coef.abs().topk(k, dim=1).indices
        vals = coef.gather(1, idx)
        # Decoupling: subtract the transmitted part from the momentum.
        sent = torch.zeros_like(coef).scatter_(1, idx, vals).reshape(-1, h, w)
        dec = fh @ sent @ fw.T
        m -= dec.reshape(rows // h, cols // w, h, w).permute(0, 2, 1, 3).reshape(m.shape)
        signs = (vals > 0).flatten().numpy()
        import numpy as np

        out.append(idx.to(torch.int16).flatten().numpy().tobytes())
        out.append(np.packbits(signs).tobytes())
        kept += idx.numel()
    blob = b"".join(out)
    with open(a.output, "wb") as f:
        f.write(blob)
    print(f"reference: {len(tensors)} tensors, {kept} coefficients kept, {len(blob)} bytes "
          f"in {time.time() - t0:.2f} s")


def run_child(cmd, env=None):
    """Run `cmd`; return (wall seconds, peak resident bytes of that child alone)."""
    t0 = time.time()
    p = subprocess.Popen(cmd, env=env)
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.time() - t0
    if status != 0:
        sys.exit(f"{cmd[0]} failed with status {status}")
    return wall, ru.ru_maxrss * 1024  # Linux reports KiB


def cmd_compare(a):
    size = os.path.getsize(a.input)
    rows = []
    for r in range(a.repeat):
        sw = run_child([a.swarm, "codec", "encode", "--input", a.input, "--topk", str(a.topk),
                        "--chunk", str(a.chunk), "--values", "sign", "--output", a.out + ".swarm"])
        ref = run_child([sys.executable, __file__, "encode", a.input, "--topk", str(a.topk),
                         "--chunk", str(a.chunk), "--output", a.out + ".ref"])
        rows.append((sw, ref))
        print(f"run {r + 1}/{a.repeat}: swarm {sw[0]:.2f} s, {sw[1] / 1e9:.2f} GB; "
              f"reference {ref[0]:.2f} s, {ref[1] / 1e9:.2f} GB", flush=True)
    med = lambda xs: sorted(xs)[len(xs) // 2]
    sw_t, ref_t = med([r[0][0] for r in rows]), med([r[1][0] for r in rows])
    sw_m, ref_m = max(r[0][1] for r in rows), max(r[1][1] for r in rows)
    print(f"\ninput {a.input}: {size / 1e9:.3f} GB")
    print(f"{'':<28}{'wall (median)':>14}{'peak RSS':>12}{'peak / input':>14}")
    print(f"{'swarm codec encode':<28}{sw_t:>12.2f} s{sw_m / 1e9:>10.2f} GB{sw_m / size:>13.2f}x")
    print(f"{'PyTorch reference':<28}{ref_t:>12.2f} s{ref_m / 1e9:>10.2f} GB{ref_m / size:>13.2f}x")
    print(f"swarm is {ref_t / sw_t:.2f}x the reference's speed")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make", help="write a synthetic Llama-like safetensors file")
    m.add_argument("path")
    m.add_argument("--layers", type=int, default=6)
    m.add_argument("--dim", type=int, default=1664)
    m.add_argument("--ffn", type=int, default=4480)
    m.add_argument("--seed", type=int, default=0)
    e = sub.add_parser("encode", help="the per-tensor PyTorch DeMo encode of a file")
    e.add_argument("input")
    e.add_argument("--output", required=True)
    c = sub.add_parser("compare", help="swarm codec encode vs this reference, whole processes")
    c.add_argument("--swarm", required=True)
    c.add_argument("--input", required=True)
    c.add_argument("--out", default="/tmp/codec-compare")
    c.add_argument("--repeat", type=int, default=3)
    for s in (e, c):
        s.add_argument("--topk", type=int, default=4)
        s.add_argument("--chunk", type=int, default=64)
    a = p.parse_args()
    {"make": cmd_make, "encode": cmd_encode, "compare": cmd_compare}[a.cmd](a)


if __name__ == "__main__":
    main()
