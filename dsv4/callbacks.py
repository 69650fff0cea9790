"""Hydra callbacks (configured in configs/config.yaml under `hydra.callbacks`).

Hydra 1.3.8 instantiates each callback from its `_target_` and calls every hook through `getattr`
(hydra/_internal/callbacks.py), for single runs too, so a callback is a plain class that defines all
six hooks; it needs no base class. This module imports nothing heavy: it is loaded by every
`python run.py`, including `mode=check`, which must not import torch.
"""
from __future__ import annotations

from typing import Any


class SummarizeCallback:
    """At the end of a multirun, the sweep folder's summary (`dsv4.summarize`, the code behind
    `mode=summarize`): summary.csv, summary.md, summary.png. A sweep in which some job failed with a
    real error (an `error` row, not `incompatible`) then exits with status 1, after the summary is
    written. An interrupted sweep never reaches this hook: `mode=summarize +sweep_dir=PATH` summarizes it."""

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        pass

    def on_run_end(self, config: Any, **kwargs: Any) -> None:
        pass

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        pass

    def on_job_start(self, config: Any, **kwargs: Any) -> None:
        pass

    def on_job_end(self, config: Any, **kwargs: Any) -> None:
        pass

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        if str(config.get("mode", "run")) != "run":      # only `run` jobs write result rows
            return
        from dsv4.summarize import summarize

        s = summarize(str(config.hydra.sweep.dir))
        s.show()
        if s.counts.get("error"):
            # SystemExit passes through Hydra's callback wrapper (it catches Exception only)
            raise SystemExit(f"error: {s.counts['error']} of {len(s.rows)} jobs failed with an error "
                             f"(their rows and messages: {s.md_path})")
