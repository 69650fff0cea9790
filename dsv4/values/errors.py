"""Errors users see: one message per failure, naming what to change."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class Problem:
    group: str                       # config group or key to change, e.g. "cache_layout", "tp_size"
    value: str                       # what was chosen
    reason: str                      # who requires what, in plain words
    supported: tuple[str, ...] = ()  # the values that would satisfy this rule
    fix: str | None = None           # an override the user can paste

    def line(self) -> str:
        s = f"- {self.group}={self.value}: {self.reason}"
        if self.supported:
            s += f" (supported: {', '.join(self.supported)})"
        if self.fix:
            s += f"   fix: {self.fix}"
        return s

    def as_dict(self) -> dict[str, object]:
        return {"group": self.group, "value": self.value, "reason": self.reason,
                "supported": list(self.supported), "fix": self.fix}


class IncompatibleCombination(ValueError):
    """Raised before anything is allocated when `check()` found problems."""

    def __init__(self, problems: list[Problem], *, header: str, choices: str) -> None:
        self.problems = list(problems)
        lines = [header, f"  {choices}"] + [f"  {p.line()}" for p in problems]
        lines.append("Nothing was allocated. `dsv4 mode=info` lists what each option needs.")
        super().__init__("\n".join(lines))


class ConfigError(ValueError):
    """A config value that cannot mean anything (unknown mode, a model spec that breaks the layer's
    invariants, an option whose fields are invalid): said plainly, without a traceback, by the CLI."""


class InvalidRequest(ValueError):
    """A step was refused: nothing was written to any cache, no request's state changed."""


class ResultMismatch(ValueError):
    """A run finished but a layer's outputs are degenerate (zero, constant, non-finite) or further from the
    oracle, or from exact float32 rows, than the combination's budgets allow: the result is wrong (its row
    says `mismatch`)."""


class RankFailed(RuntimeError):
    """A rank process of a job failed; that process said why (its message, or its traceback where the error
    was not a user's), so this one only names the job."""


# errors whose message says what to change (or, a failed rank, where it was said): printed without a traceback
USER_ERRORS = (ConfigError, IncompatibleCombination, InvalidRequest, ResultMismatch, RankFailed)
