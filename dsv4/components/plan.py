"""The step plan: every device tensor the layers of one step read, built once per step.

A serving engine already has what a plan is made of -- per request, where its tokens sit in the batch
(`query_start`, [B+1]) and its length after the step (`seq_lens`, [B]), and the block tables of its
page groups -- and can fill one without our `Engine`:

    plan = StepPlan.build(query_start=qs, seq_lens=lens, swa=PageTable(block_size=64, pages=swa_tables),
                          state={4: PageTable(...), 128: PageTable(...)},
                          entries={4: PageTable(...), 128: PageTable(...)}, window=128)
    y = layer(x, plan, caches)

`build` derives the rest on the device, without a host sync and with shapes fixed by its inputs' (so a
CUDA graph can capture it): each token's request and position, the SWA slot its row goes to and the
window it reads, which compressed entry it closes and how many it sees, the compressor-state rows kept
after the step, and for ratio-128 layers the list of every visible entry. Rows past `query_start[-1]`
and requests with no tokens are padding: they write nothing and read nothing.

Page tables hold physical page ids, -1 where a logical page has none; slot = page·block_size + offset,
with the offset of a position (SWA, state) or of an entry index (entries).

Each layer type's strategy plans for the step (its MQA kernel's `plan()`, at ratio 4 its indexer's) are
made once and travel with the plan, read-only: `plan.with_type_plans({layer_type: TypePlan(...)})` is the
same plan carrying them, for every layer of those types.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Mapping

from dsv4.kernels.mqa.sparse_plan import RUN_GROUP
from dsv4.values.layer_types import by_ratio
from dsv4.values.seam import QueryRuns

RUN_GROUPS = (RUN_GROUP,)               # QueryRuns.groups sizes a captured step makes in its plan's graph


@dataclass(frozen=True, slots=True, kw_only=True)
class PageTable:
    """One page group's block tables for the step's requests: [B, P] int32 physical pages (-1: none)."""
    block_size: int
    pages: Any

    def slots(self, request, rows):
        """Global slots of logical rows `rows` ([T] or [T, N]; -1 = none) of each token's request
        `request` [T]; -1 where a row has no page."""
        import torch

        flat = rows.dim() == 1
        r = rows[:, None] if flat else rows
        bs, width = self.block_size, self.pages.shape[1]
        logical = r.clamp(min=0) // bs
        page = self.pages[request[:, None], logical.clamp(max=max(width - 1, 0)).long()] if width \
            else torch.full_like(r, -1)
        ok = (r >= 0) & (logical < width) & (page >= 0)
        out = torch.where(ok, page * bs + r.clamp(min=0) % bs, torch.full_like(r, -1)).to(torch.int32)
        return out[:, 0] if flat else out


@dataclass(frozen=True, slots=True, kw_only=True)
class SwaRows:
    table: PageTable
    write_slots: Any        # [T] int32: where each token's SWA row goes (-1: padding)
    indices: Any            # [T, W] int32: the window's slots, -1 padded
    lens: Any               # [T] int32: min(position + 1, W), 0 for padding


@dataclass(frozen=True, slots=True, kw_only=True)
class StateRows:
    table: PageTable
    keep: int               # positions the compressor reads back
    write_slots: Any        # [T] int32: where a token's (candidate, gate) row goes if a later step reads it, else -1


@dataclass(frozen=True, slots=True, kw_only=True)
class EntryRows:
    ratio: int
    table: PageTable
    counts: Any             # [T] int32: entries visible to the token, (position + 1) // ratio
    close_slots: Any        # [T] int32: the slot of the entry the token closes ((position + 1) % ratio == 0), else -1
    width: int              # entries a request of the step can have (the tables' capacity)
    visible: Any = None     # [T, width] int32 slots of every visible entry (-1 padded), for dense ratios


@dataclass(frozen=True, slots=True, kw_only=True)
class TypePlan:
    """One layer type's strategy plans for a step, made once and shared by that type's layers."""
    kernel: Any = None      # its MQA kernel's plan() (None: the kernel makes its own per call)
    indexer: Any = None     # its indexer's plan(), ratio-4 types (None: none, or the torch path)


NO_TYPE_PLAN = TypePlan()


def _no_type_plans() -> Mapping[str, TypePlan]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True, kw_only=True)
class StepPlan:
    num_tokens: int                   # T: rows of the step's tensors (padding included)
    query_start: Any                  # [B+1] int32
    seq_lens: Any                     # [B] int32: each request's length after the step
    positions: Any                    # [T] int32 (0 for padding)
    token_request: Any                # [T] int64: the token's request (index into seq_lens)
    step_start: Any                   # [T] int32: the first position of the token's request in this step
    real: Any                         # [T] bool: not padding
    runs: QueryRuns         # a request's tokens in the step; padding rows are runs of one
    swa: SwaRows
    state: dict[int, StateRows]
    entries: dict[int, EntryRows]
    type_plans: Mapping[str, TypePlan] = field(default_factory=_no_type_plans)   # layer type -> its plans
    _rope: dict = field(default_factory=dict)

    @property
    def device(self):
        return self.positions.device

    def with_type_plans(self, plans: Mapping[str, TypePlan]) -> "StepPlan":
        """This plan carrying `plans` (layer type -> TypePlan), read-only; the RoPE rows made so far and later
        are shared with this plan's."""
        return replace(self, type_plans=MappingProxyType(dict(plans)))

    def type_plan(self, layer_type: str) -> TypePlan:
        """The step's plans of `layer_type` (empty if none were made)."""
        return self.type_plans.get(layer_type, NO_TYPE_PLAN)

    @classmethod
    def build(cls, *, query_start, seq_lens, swa: PageTable, window: int, state: dict[int, PageTable] | None = None,
              entries: dict[int, PageTable] | None = None, num_tokens: int | None = None) -> "StepPlan":
        """Derive the plan from the engine's view of the step (int32 device tensors; see the module
        docstring). `num_tokens` defaults to query_start[-1] (one host read); give it to avoid that."""
        import torch

        qs = query_start.to(torch.int32)
        lens = seq_lens.to(torch.int32)
        T = int(qs[-1]) if num_tokens is None else int(num_tokens)
        B = lens.shape[0]
        dev = qs.device
        t = torch.arange(T, device=dev, dtype=torch.int32)
        req = torch.searchsorted(qs[1:], t, right=True).clamp(max=max(B - 1, 0))
        real = t < qs[-1]
        first_row = qs.index_select(0, req)
        count = qs.index_select(0, req + 1) - first_row
        start = lens.index_select(0, req) - count
        pos = torch.where(real, start + (t - first_row), torch.zeros_like(t))
        none = torch.full_like(t, -1)

        # SWA: the token's own row, and the window max(0, p-W+1)..p it attends to
        lo = (pos - window + 1).clamp(min=0)
        local = lo[:, None] + torch.arange(window, device=dev, dtype=torch.int32)[None, :]
        local = torch.where((local <= pos[:, None]) & real[:, None], local, torch.full_like(local, -1))
        swa_rows = SwaRows(table=swa, write_slots=torch.where(real, swa.slots(req, pos), none),
                           indices=swa.slots(req, local),
                           lens=torch.where(real, torch.minimum(pos + 1, torch.full_like(pos, window)), torch.zeros_like(t)))

        states = {}
        for ratio, table in (state or {}).items():
            keep = by_ratio(ratio).reach
            kept = real & (pos >= lens.index_select(0, req) - keep + 1)      # read by a later step
            states[ratio] = StateRows(table=table, keep=keep, write_slots=torch.where(kept, table.slots(req, pos), none))

        ents = {}
        for ratio, table in (entries or {}).items():
            counts = torch.where(real, (pos + 1) // ratio, torch.zeros_like(t))
            closes = real & ((pos + 1) % ratio == 0)
            close = torch.where(closes, table.slots(req, counts - 1), none)
            width = table.pages.shape[1] * table.block_size
            visible = None
            if not by_ratio(ratio).indexed:
                cols = torch.arange(max(width, 1), device=dev, dtype=torch.int32)[None, :]
                visible = table.slots(req, torch.where(cols < counts[:, None], cols, torch.full_like(cols, -1)))
            ents[ratio] = EntryRows(ratio=ratio, table=table, counts=counts, close_slots=close, width=width,
                                    visible=visible)
        # runs: the token's index among its request's tokens and how many are left; padding, runs of one
        runs = QueryRuns(tokens=torch.stack((torch.where(real, t - first_row, 0),
                                             torch.where(real, count - (t - first_row), 1)), 1))
        return cls(num_tokens=T, query_start=qs, seq_lens=lens, positions=pos, token_request=req, step_start=start,
                   real=real, runs=runs, swa=swa_rows, state=states, entries=ents)

    # ---- per-step values derived once and shared by the layers that use them ------------------
    def rope_rows(self, rope, shift: int = 0):
        """`rope` (a components.rope.Rope) at the tokens' positions, or with shift=R at the first
        position of the entry each token closes (position + 1 - R): the RopeRows, made once per step."""
        key = (rope, shift)
        if key not in self._rope:
            self._rope[key] = rope.at(self.positions if not shift else (self.positions + 1 - shift).clamp(min=0))
        return self._rope[key]

    def validate(self, *, swa_blocks: int, state_blocks: dict[int, int] | None = None,
                 entry_blocks: dict[int, int] | None = None) -> None:
        """For plans an engine filled itself: refuse page ids outside the pools, rows the step writes
        without a page and inconsistent lengths, with one ValueError (host reads; our Engine's plans are
        correct by construction)."""
        errors = []
        qs, lens = self.query_start.cpu(), self.seq_lens.cpu()
        counts = qs[1:] - qs[:-1]
        if bool((counts < 0).any()):
            errors.append("query_start must be non-decreasing")
        if bool((lens < counts.clamp(min=0)).any()):
            errors.append("seq_lens must be at least each request's tokens in the step")
        tables = [("swa", self.swa.table, swa_blocks)]
        tables += [(f"state[{r}]", s.table, (state_blocks or {}).get(r)) for r, s in self.state.items()]
        tables += [(f"entries[{r}]", e.table, (entry_blocks or {}).get(r)) for r, e in self.entries.items()]
        for name, table, blocks in tables:
            p = table.pages.cpu()
            if p.shape[0] != lens.shape[0]:
                errors.append(f"{name} table has {p.shape[0]} rows for {lens.shape[0]} requests")
            if blocks is not None and p.numel() and bool(((p < -1) | (p >= blocks)).any()):
                bad = p[(p < -1) | (p >= blocks)][:5].tolist()
                errors.append(f"{name} table names pages {bad} outside the pool [0, {blocks}) (-1 = none)")
        real = self.real.cpu()
        holes = [("an SWA row", self.swa.write_slots.cpu()[real])]
        holes += [(f"a ratio-{r} entry", e.close_slots.cpu()[(e.counts.cpu() > 0) & real
                                                             & ((self.positions.cpu() + 1) % r == 0)])
                  for r, e in self.entries.items()]
        for what, slots in holes:
            if bool((slots < 0).any()):
                errors.append(f"{what} of the step has no page in its table")
        if errors:
            raise ValueError("step plan refused: " + "; ".join(errors))
