"""A training loop that resumes from a converted checkpoint on every rank (torchrun-ready).

    torchrun --nproc-per-node 2 scripts/train_resume.py --ckpt example_run/step3.safetensors --fsdp fsdp2

Builds the model (on the meta device for FSDP2: no random init), shards it with FSDP2 or FSDP1,
restores weights and AdamW state (each rank reads only its slice; the NaN-fill check proves
everything was restored), then trains a few more steps. Uses gloo on CPU, NCCL when GPUs exist.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import fsdp_restore
from example_model import batch, build_model, loss_fn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--fsdp", choices=["fsdp2", "fsdp1"], default="fsdp2")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--save", help="after training, save from the shards here (every rank writes its own bytes)")
    parser.add_argument("--verify-save", action="store_true",
                        help="read back what the save wrote before it replaces the old checkpoint (verify_checksums)")
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)  # bound to this rank's GPU from the start
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()

    if args.fsdp == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        with torch.device("meta"):  # no memory, no random init: the restore provides every value
            model = build_model()
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        model.to_empty(device=device)
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        # FSDP1 materializes meta modules with param_init_fn, and to_empty(recurse=False) there unties
        # tied weights (fsdp_restore's optimizer check reports it), so build this one on the host.
        model = FSDP(build_model(), device_id=device, use_orig_params=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)

    extra = fsdp_restore.restore(model, args.ckpt, optimizer=optimizer)
    step = extra["step"]
    if rank == 0:
        print(f"restored step {step} on {dist.get_world_size()} ranks ({args.fsdp}); NaN-fill check passed;"
              f" extra keys: {sorted(extra)}")
    for _ in range(args.steps):
        loss = loss_fn(model, batch(step, device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        if rank == 0:
            print(f"step {step} loss {loss.item():.6f}")
    if args.save:  # the rest of the checkpoint (RNG, config...) comes along from rank 0, with the new step
        report = fsdp_restore.save_sharded(model, args.save, optimizer=optimizer, extra={**extra, "step": step},
                                           verify_checksums=args.verify_save)
        if rank == 0:
            print(f"saved step {step} to {report.path}: {report.nbytes / 1e6:.1f} MB, each rank writing its own"
                  f" share (rank 0: {report.bytes_written / 1e6:.1f} MB), no gather"
                  + (", and read it back from the storage" if args.verify_save else ""))
    dist.barrier()  # no rank tears its process group down while a peer is still using it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
