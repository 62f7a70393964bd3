"""Save and load training checkpoints with ``torch.distributed.checkpoint``, in files that load without
running code.

    from autoshard import checkpoint
    checkpoint.save({"model": cm.state_dict(), "optim": cm.optimizer_state_dict(opt),
                     "scheduler": scheduler.state_dict(), "step": step}, f"ckpt/{step}")   # every rank
    state = {"model": cm.state_dict(), "optim": cm.optimizer_state_dict(opt),
             "scheduler": scheduler.state_dict(), "step": 0}
    checkpoint.load(state, f"ckpt/{step}")                                              # fills state in place
    cm.load_state_dict(state["model"]); cm.load_optimizer_state_dict(opt, state["optim"])

Each rank writes the pieces it holds; a load reads the pieces the loading program's plan places on it,
so a checkpoint saved under one plan, mesh or pipeline loads under another. ``cm.state_dict()`` works
with stock ``torch.distributed.checkpoint.save`` / ``load`` too (as torchtitan calls them), but their
file format unpickles its metadata on load; ``save`` / ``load`` here keep DCP's planning and write JSON
metadata and raw tensor bytes instead (``autoshard.runtime.checkpoint_files``).

``save_checkpoint(state, root, step)`` saves into a new directory under ``root`` and then switches the
pointer file ``root/LATEST`` to it atomically, so a save killed at any moment leaves the previous
checkpoint loadable; ``latest_checkpoint(root)`` is ``(directory, step)`` of the one it names
(``autoshard.runtime.checkpoint_pointer``).
"""
from autoshard.runtime.checkpoint_files import load, save  # noqa: F401
from autoshard.runtime.checkpoint_pointer import checkpoint_info, latest_checkpoint, save_checkpoint  # noqa: F401

__all__ = ["save", "load", "save_checkpoint", "latest_checkpoint", "checkpoint_info"]
