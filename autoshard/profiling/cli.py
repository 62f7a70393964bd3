"""``autoshard profile``: measure this machine and write a JSON profile the planner can use.

    autoshard profile --out profile.json [--quick] [--nproc 4]      # spawns 4 CPU processes (gloo)
    torchrun --nproc_per_node 8 -m autoshard.cli profile --out p.json  # each torchrun rank joins (NCCL on GPUs)

Then ``autoshard.plan(model, mesh, ..., hardware="profile.json")``. Prints the fitted figures and
their prediction error on held-back sizes that no fit saw.
"""
from __future__ import annotations

import argparse
import os
import sys

__all__ = ["add_parser", "run"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register the ``profile`` subcommand on an ``argparse`` subparsers object."""
    p = subparsers.add_parser("profile", help="measure this machine (compute, memory, collectives) into a JSON profile",
                              description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="where to write the profile JSON")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repeats (about 30 s on a small CPU box)")
    p.add_argument("--nproc", type=int, default=4,
                   help="local CPU processes to spawn when not launched by torchrun (default 4)")
    p.add_argument("--name", default=None, help="name stored in the profile (default: host, device and world size)")
    return p


def run(args: argparse.Namespace) -> int:
    """Measure and write ``args.out``; returns the exit status."""
    import torch.distributed as dist

    from autoshard.passes.cost.profile_format import Profile
    from autoshard.profiling.measure import ProfileConfig, measure_profile, spawn_profile

    config = ProfileConfig.make(quick=args.quick)
    if "WORLD_SIZE" in os.environ:  # launched by torchrun: every rank measures, rank 0 writes
        from autoshard.runtime.groups import choose_device_backend
        device, backend = choose_device_backend()
        if device.type == "cuda":
            import torch
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            dist.init_process_group(backend)
        data = measure_profile(config, name=args.name,
                               log=lambda m: print(f"autoshard profile: {m}", file=sys.stderr) if dist.get_rank() == 0
                               else None)
        dist.barrier()
        dist.destroy_process_group()
        if data is None:
            return 0
    else:
        data = spawn_profile(args.nproc, config, name=args.name)
    profile = Profile.from_json(data)
    profile.save(args.out)
    print(profile.summary())
    print(f"wrote {args.out} (took {data.get('seconds', 0.0):.1f} s to measure); use it with "
          f"autoshard.plan(..., hardware={args.out!r})")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="autoshard")
    add_parser(ap.add_subparsers(dest="command", required=True))
    sys.exit(run(ap.parse_args()))
