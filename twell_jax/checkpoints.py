"""Orbax checkpoints of a model and its optimizer: the newest two kept, written atomically,
restored onto the arrays' current placement.

Each checkpoint records the layout of its FFN weights (item ``layout``). Checkpoints without it
were written when ``w_gate`` and ``w_up`` were stored [D, F]: they are restored in that layout
and transposed once to today's [F, D] (``twell_jax.layout``), their optimizer moments alike."""

from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp
from flax import nnx

LAYOUT = {"ffn_weights": "unit_rows"}
"""The ``layout`` item every checkpoint records: FFN weights [F, D], one row per unit."""

_TRANSPOSED_BEFORE = ("w_gate", "w_up")  # the FFN weights stored [D, F] before the layout item


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
        optimizer=ocp.args.StandardSave(nnx.state(optimizer)),
        layout=ocp.args.JsonSave(LAYOUT)))
    manager.wait_until_finished()


def restore_checkpoint(manager: ocp.CheckpointManager, model, optimizer=None) -> int:
    """Loads the newest checkpoint into model and optimizer (only the model when optimizer is
    None, as for sampling); returns its step (0 if none). ValueError naming the checkpoint
    when it does not fit (another model's: other parameters or shapes)."""
    step = manager.latest_step()
    if step is None:
        return 0
    targets = {"model": model} if optimizer is None else {"model": model, "optimizer": optimizer}
    step_dir = Path(manager.directory) / str(step)
    earlier_layout = not (step_dir / "layout").exists()
    abstract = lambda obj: jax.tree_util.tree_map_with_path(_abstract_leaf(earlier_layout),
                                                            nnx.state(obj))
    try:
        restored = manager.restore(step, args=ocp.args.Composite(
            **{name: ocp.args.StandardRestore(abstract(obj)) for name, obj in targets.items()}))
    except (ValueError, KeyError, TypeError) as e:
        # Orbax's message lists whole trees: its first line says what differs.
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"the checkpoint of step {step} in {step_dir} "
                         f"does not fit the model: {first}") from None
    for name, obj in targets.items():
        state = restored[name]
        if earlier_layout:
            state = jax.tree_util.tree_map_with_path(
                lambda path, v: v.T if _was_transposed(path, v) else v, state)
        nnx.update(obj, state)
    return int(step)


def _was_transposed(path, leaf) -> bool:
    """Whether a state leaf is an FFN weight (or its optimizer moment) that checkpoints without
    the layout item hold as [D, F]."""
    keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    return getattr(leaf, "ndim", 0) == 2 and "ffn" in keys and any(
        name in keys for name in _TRANSPOSED_BEFORE)


def _abstract_leaf(earlier_layout: bool):
    def leaf(path, v):
        struct = ocp.utils.to_shape_dtype_struct(v)
        if earlier_layout and _was_transposed(path, struct):
            return jax.ShapeDtypeStruct(struct.shape[::-1], struct.dtype,
                                        sharding=_transposed_sharding(struct.sharding))
        return struct
    return leaf


def _transposed_sharding(sharding):
    """A [F, D] array's placement for its [D, F] transpose (a named sharding's spec reversed)."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (2 - len(sharding.spec))
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec[::-1]))
    return sharding
