#!/usr/bin/env python3
"""Check a `swarm export` directory against swarm's own logits.

    python scripts/hf_check.py HF_DIR REF.safetensors [TOLERANCE]

REF holds `tokens` (int64, [B, T]) and `logits` (float32, [B, T, V]) that swarm computed on
the same weights. Loads HF_DIR with transformers' AutoModelForCausalLM, checks it is a
LlamaForCausalLM, runs the tokens and prints one JSON line (class, max |difference|). Exit
status 1 when the difference exceeds TOLERANCE (default 1e-4).
"""
import json
import sys

import torch
import transformers
from safetensors.torch import load_file


def main():
    hf_dir, ref_path = sys.argv[1], sys.argv[2]
    tol = float(sys.argv[3]) if len(sys.argv) > 3 else 1e-4
    ref = load_file(ref_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        logits = model(ref["tokens"]).logits.float()
    diff = (logits - ref["logits"]).abs().max().item()
    out = {
        "class": type(model).__name__,
        "transformers": transformers.__version__,
        "shape": list(logits.shape),
        "max_abs_diff": diff,
        "max_abs_logit": ref["logits"].abs().max().item(),
        "tolerance": tol,
    }
    print(json.dumps(out))
    ok = out["class"] == "LlamaForCausalLM" and diff <= tol
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
