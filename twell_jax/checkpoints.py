"""Orbax checkpoints of a model and its optimizer: the newest two kept, written atomically,
restored onto the arrays' current placement."""

from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp
from flax import nnx


def checkpoint_manager(run_dir: Path, writer: bool = False) -> ocp.CheckpointManager:
    """The manager of ``run_dir/ckpt``. ``writer``: the training run that will save there;
    it removes the temporary folders of saves a killed process left behind (a reader must
    not: they may belong to a save in progress)."""
    return ocp.CheckpointManager(
        (run_dir / "ckpt").absolute(),
        options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True,
                                             cleanup_tmp_directories=writer))


def save_checkpoint(manager: ocp.CheckpointManager, step: int, model, optimizer) -> None:
    manager.save(step, args=ocp.args.Composite(
        model=ocp.args.StandardSave(nnx.state(model)),
        optimizer=ocp.args.StandardSave(nnx.state(optimizer))))
    manager.wait_until_finished()


def restore_checkpoint(manager: ocp.CheckpointManager, model, optimizer=None) -> int:
    """Loads the newest checkpoint into model and optimizer (only the model when optimizer is
    None, as for sampling); returns its step (0 if none). ValueError naming the checkpoint
    when it does not fit (another model's: other parameters or shapes)."""
    step = manager.latest_step()
    if step is None:
        return 0
    targets = {"model": model} if optimizer is None else {"model": model, "optimizer": optimizer}
    abstract = lambda obj: jax.tree.map(ocp.utils.to_shape_dtype_struct, nnx.state(obj))
    try:
        restored = manager.restore(step, args=ocp.args.Composite(
            **{name: ocp.args.StandardRestore(abstract(obj)) for name, obj in targets.items()}))
    except (ValueError, KeyError, TypeError) as e:
        # Orbax's message lists whole trees: its first line says what differs.
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"the checkpoint of step {step} in {Path(manager.directory) / str(step)} "
                         f"does not fit the model: {first}") from None
    for name, obj in targets.items():
        nnx.update(obj, restored[name])
    return int(step)
