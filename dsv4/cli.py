"""The `dsv4` command (`dsv4 [overrides]`, `python -m dsv4`, `python run.py`): Hydra composes the packaged
configs (dsv4/configs, found relative to this module, so an installed wheel works from any folder), then
dsv4.app runs the job. Outputs go under the current folder (outputs/, multirun/), as Hydra's run dirs say."""
from __future__ import annotations

from typing import Any, Mapping

import os
import sys

import hydra
from omegaconf import DictConfig, OmegaConf

# `${dsv4.pid:}` in the run and sweep folders (configs/config.yaml): two runs started in the same second
# (both `outputs/<time>/`) would write one folder, and one result would be lost
OmegaConf.register_new_resolver("dsv4.pid", os.getpid, replace=True)


def group_choices(choices: Mapping[str, Any]) -> dict[str, str]:
    """The config groups picked for a job (Hydra's runtime choices without Hydra's own groups)."""
    return {k: v for k, v in choices.items() if not k.startswith("hydra") and v is not None}


@hydra.main(version_base="1.3", config_path="configs", config_name="config")
def main(cfg: DictConfig) -> float | None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from dsv4.app import cli   # heavy imports only after composition (hydra#934)

    hc = HydraConfig.get()
    try:
        return cli(cfg, choices=group_choices(hc.runtime.choices), out_dir=hc.runtime.output_dir,
                   multirun=hc.mode == RunMode.MULTIRUN)
    except BrokenPipeError:
        # stdout was closed by its reader (`python run.py | head -1`): the job's row is written (and is
        # never replaced); stop printing quietly, with the status of a process ended by SIGPIPE
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(141) from None
