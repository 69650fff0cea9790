"""The `dsv4` command (`dsv4 [overrides]`, `python -m dsv4`, `python run.py`): Hydra composes the packaged
configs (dsv4/configs, found relative to this module, so an installed wheel works from any folder), then
dsv4.app runs the job. Outputs go under the current folder (outputs/, multirun/), as Hydra's run dirs say."""
from __future__ import annotations

from typing import Any, Mapping

import hydra
from omegaconf import DictConfig


def group_choices(choices: Mapping[str, Any]) -> dict[str, str]:
    """The config groups picked for a job (Hydra's runtime choices without Hydra's own groups)."""
    return {k: v for k, v in choices.items() if not k.startswith("hydra") and v is not None}


@hydra.main(version_base="1.3", config_path="configs", config_name="config")
def main(cfg: DictConfig) -> float | None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from dsv4.app import cli   # heavy imports only after composition (hydra#934)

    hc = HydraConfig.get()
    return cli(cfg, choices=group_choices(hc.runtime.choices), out_dir=hc.runtime.output_dir,
               multirun=hc.mode == RunMode.MULTIRUN)
