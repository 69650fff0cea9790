"""Entry point: `python run.py [overrides]`. A trampoline; the app lives in dsv4/app.py."""
import hydra
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path="configs", config_name="config")
def main(cfg: DictConfig) -> float | None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from dsv4.app import cli   # heavy imports only after composition (hydra#934)

    hc = HydraConfig.get()
    choices = {k: v for k, v in hc.runtime.choices.items() if not k.startswith("hydra") and v is not None}
    return cli(cfg, choices=choices, out_dir=hc.runtime.output_dir, multirun=hc.mode == RunMode.MULTIRUN)


if __name__ == "__main__":
    main()
