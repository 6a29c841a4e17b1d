"""Train the example model for a few steps on one process and torch.save a full training checkpoint,
the way large runs save unsharded checkpoints (model, optimizer, step, RNG, config)."""

from __future__ import annotations

import argparse
import random

import numpy as np
import torch

from example_model import batch, build_model, loss_fn

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--steps", type=int, default=3)
args = parser.parse_args()

torch.manual_seed(0)
model = build_model()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
for step in range(args.steps):
    loss = loss_fn(model, batch(step))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    print(f"step {step + 1} loss {loss.item():.6f}")
torch.save({"model": model.state_dict(), "optim": optimizer.state_dict(), "step": args.steps,
            "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
            "config": argparse.Namespace(lr=1e-3, layers=3, dim=67)}, args.out)
print(f"saved {args.out}")
