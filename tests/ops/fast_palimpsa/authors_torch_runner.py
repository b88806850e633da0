"""Runs the authors' Fast Palimpsa (their PyTorch file, loaded from its path) on saved inputs.

  python authors_torch_runner.py AUTHORS_FILE INPUTS.npz OUTPUTS.npz

AUTHORS_FILE is `Palimpsa/palimpsa/ops/fast_palimpsa/chunk_fast_palimpsa_v2.py` of the
authors' repository (djo1996/Mesa_Palimpsa); nothing of it is copied here. Needs numpy and
torch only (not this project), so it may run under another Python than the tests: torch CPU
wheels and the project's jax need not exist for the same Python version.

Inputs are in the authors' convention: q, k [B,L,H,K]; v, b [B,L,H,V]; gt [B,L,H] (their dt)
and g [H] (their A), the decay being exp(-gt * g); Ip [H]; cot [B,L,H,V]; chunk_size. For their
loop reference, their vectorised form and their token-exact recurrence, in float64 and float32,
writes the output y and the grads of sum(y * cot) w.r.t. q, k, v, b, gt, Ip.
"""

import importlib.util
import sys

import numpy as np
import torch

FUNCTIONS = {"ref": "fast_palimpsa_ref", "vec": "fast_palimpsa_vec", "exact": "_exact_recurrence"}
DIFF = ("q", "k", "v", "b", "gt", "Ip")


def main(authors_file, inputs_path, outputs_path):
  spec = importlib.util.spec_from_file_location("authors_fast_palimpsa", authors_file)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  x = dict(np.load(inputs_path))
  chunk_size = int(x.pop("chunk_size"))
  outputs = {}
  for dtype in (torch.float64, torch.float32):
    for name, function in FUNCTIONS.items():
      t = {n: torch.tensor(a, dtype=dtype, requires_grad=n in DIFF) for n, a in x.items()}
      args = [t[n] for n in ("q", "k", "v", "b", "gt", "g", "Ip")]
      kwargs = {} if name == "exact" else {"chunk_size": chunk_size}
      y = getattr(module, function)(*args, scale=1.0, **kwargs)  # q arrives already scaled
      (y * t["cot"]).sum().backward()
      tag = f"{name}_{str(dtype).removeprefix('torch.')}"
      outputs[f"{tag}_y"] = y.detach().numpy()
      for n in DIFF:
        outputs[f"{tag}_d{n}"] = t[n].grad.numpy()
  np.savez(outputs_path, **outputs)


if __name__ == "__main__":
  main(*sys.argv[1:])
