"""Settings a user gave that change nothing in the chosen job, each named once with why (a warning, not an
error: the job still runs, but what was asked for is not what happens). Pure Python: read before the work."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from dsv4.values.layer_types import INDEXED, by_ratio


@dataclass(frozen=True, slots=True, kw_only=True)
class Inert:
    """Keys (a key or a section's prefix) that have no effect while `why(job, multirun)` says so."""
    keys: tuple[str, ...]
    why: Callable[..., str | None]


def _nothing_indexed(job) -> str | None:
    """Why an `indexer` setting changes nothing: no ratio-4 layer among the job's layers (None if there is one)."""
    layers = list(job.workload.layer_indices(job.spec))
    if any(by_ratio(job.spec.compress_ratio(l)).indexed for l in layers):
        return None
    return f"no ratio-{INDEXED.ratio} layer among the job's layers {layers}: nothing is indexed"


RULES = (
    Inert(keys=("graph.capture_sizes", "graph.max_context"),
          why=lambda job, multirun: None if job.graphs.enabled else
          "graph.enabled=false: every step runs eagerly"),
    Inert(keys=("overlap",),
          why=lambda job, multirun: "the compressors' side stream is a GPU's; the CPU runs one stream"
          if job.device.platform == "cpu" else None),
    Inert(keys=("parallel.",),
          why=lambda job, multirun: "tp_size=1: one rank, nothing to launch or reduce" if job.combo.tp_size == 1
          else None),
    Inert(keys=("dump_overwrite",),
          why=lambda job, multirun: None if job.run.dump_dir else "no dump_dir is written"),
    Inert(keys=("checkpoint.",),
          why=lambda job, multirun: "weights=random: the layers' weights are seeded random"
          if job.run.weights == "random" else None),
    Inert(keys=("indexer",), why=lambda job, multirun: _nothing_indexed(job)),
    Inert(keys=("indexer.top_k",),
          why=lambda job, multirun: "on the CPU the indexer selects with torch.topk"
          if job.device.platform == "cpu" else None),
    Inert(keys=("bench_rows",),
          why=lambda job, multirun: None if job.run.mode == "bench" else "bench_rows is where mode=bench writes"),
    Inert(keys=("summary.",),
          why=lambda job, multirun: None if multirun else "summary is read when a sweep (-m) is summarized"),
)


def override_key(override: str) -> str:
    """The key of a command-line override (`+a.b=1`, `~a.b`, `indexer/top_k=x`) as a dotted path."""
    return override.split("=", 1)[0].lstrip("+~").replace("/", ".").strip()


def inert_settings(job, overrides: Iterable[str], *, multirun: bool = False) -> list[str]:
    """One line per override that has no effect in `job`: the key, what it was set to, and why."""
    given = {override_key(o): o for o in overrides}
    out = []
    for key, text in given.items():
        for rule in RULES:
            if any(key == k or (k.endswith(".") and key.startswith(k)) or key.startswith(k + ".")
                   for k in rule.keys):
                why = rule.why(job, multirun)
                if why:
                    out.append(f"{text} has no effect: {why}")
                    break
    return out
