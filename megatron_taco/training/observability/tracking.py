"""Weights & Biases for a run, on rank 0 only (Megatron-LM's --wandb-project,
--wandb-exp-name, --wandb-save-dir; plus --wandb-entity and --wandb-mode).

The run gets the records TensorBoard gets (logging.py: one ``<split>/<key>`` scalar per
numeric value, at the iteration as W&B's step), the run's configuration, and the loss- and
learning-curve PNGs at the end. Its id is kept in every checkpoint (metadata.json
"callbacks"["wandb"]), so a resumed run continues the same W&B run; steps logged again after
a resume from an earlier checkpoint are dropped by W&B (it keeps steps increasing).
wandb is an optional extra (pip install 'megatron_taco[wandb]'), imported only when used.
"""

from __future__ import annotations

import math
import os
from typing import Any

from megatron_taco.errors import ConfigError
from megatron_taco.training.callbacks import Callback

WANDB_STATE = "wandb"  # the callback's name: its key in metadata.json "callbacks"


class WandbRun:
    def __init__(
        self,
        *,
        project: str,
        name: str | None,
        save_dir: str | None,
        entity: str | None,
        mode: str | None,
        config: dict[str, Any],
        run_id: str | None = None,
    ) -> None:
        import wandb

        self._wandb = wandb
        if save_dir is not None:
            os.makedirs(save_dir, exist_ok=True)
        try:
            self.run = wandb.init(
                project=project,
                name=name,
                dir=save_dir,
                entity=entity,
                mode=mode,
                config=config,
                id=run_id,
                # "allow": continue the run with this id where it exists, else start it (an
                # offline run, or one whose first save came before W&B saw anything).
                resume="allow" if run_id else None,
                # No history sparklines at the end of a SLURM log.
                settings=wandb.Settings(quiet=True),
            )
        except wandb.errors.Error as e:  # no API key, a refused entity, no server
            # The library's message (it may span lines) as one line naming the flags.
            reason = " ".join(str(e).split())
            raise ConfigError(
                f"--wandb-project: W&B could not start the run: {reason} (log in with `wandb "
                "login` or WANDB_API_KEY, or use --wandb-mode offline)"
            ) from None

    @property
    def run_id(self) -> str:
        return self.run.id

    def log(self, split: str, iteration: int, metrics: dict[str, Any]) -> None:
        data = {
            f"{split}/{key}": value
            for key, value in metrics.items()
            if isinstance(value, (int, float))
            and not isinstance(value, bool)
            and math.isfinite(value)
        }
        if data:
            self.run.log(data, step=iteration)

    def image(self, name: str, path: str, iteration: int) -> None:
        self.run.log({f"plots/{name}": self._wandb.Image(path)}, step=iteration)

    def close(self) -> None:
        self.run.finish()


class WandbRunState(Callback):
    """Keeps the W&B run id in the checkpoints (rank 0 writes metadata.json and holds the
    run); a resumed run reads it from TrainingState.callback_states before it opens W&B."""

    name = WANDB_STATE

    def __init__(self, run: WandbRun | None, run_id: str | None = None) -> None:
        self.run = run
        self.run_id = run_id

    def state_dict(self) -> dict[str, Any]:
        run_id = self.run.run_id if self.run is not None else self.run_id
        return {"run_id": run_id} if run_id else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.run_id = self.run_id or state.get("run_id")


def saved_run_id(callback_states: dict[str, Any]) -> str | None:
    return (callback_states.get(WANDB_STATE) or {}).get("run_id")
