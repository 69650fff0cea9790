"""The paged caches of one tensor-parallel rank: page groups shared by every layer, each layer's storage.

A page group hands out pages of `block_size` rows and keeps one block table per request (logical
page -> physical page, -1 where none). Every layer of the rank addresses its rows through the same
tables, as serving engines share one block table per KV-cache group:

- `swa`: one row per token position; a layer's SWA KV row. Pages wholly behind the sliding window are
  freed when a step commits, so SWA memory per request is bounded by the window.
- `state[R]`: one row per token position, the compressor's (candidate, gate) rows of ratio-R layers.
  Only the rows a later step can reach are written (the last coff·R positions of a request): the rows
  of the step's own tokens are read from the step's projection, so these pages stay at most two per
  request whatever the step's size.
- `entries[R]`: one row per compressed entry (every R positions); the compressed KV rows of ratio-R
  layers and, at ratio 4, the indexer keys. Never freed while the request lives.

Steps are two-phase: `reserve` takes the pages the new tokens need (or raises before taking any),
`commit` frees what fell behind, `rollback` returns a reservation. Slot ids follow vLLM:
`slot = table[row // block_size] * block_size + row % block_size`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable

from dsv4.values.errors import InvalidRequest
from dsv4.values.layer_types import by_ratio
from dsv4.values.seam import PagedCache
from dsv4.values.settings import at_least, parse
from dsv4.values.sizes import cdiv


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolConfig:
    swa_block_size: int = at_least(1, 64)
    compressed_block_tokens: int = at_least(1, 256)   # positions per compressed page: 64 entries at R=4, 2 at
                                                      # R=128 (at least one entry per page)
    swa_blocks: int = at_least(1, 64)
    compressed_blocks: int = at_least(1, 64)
    max_requests: int = at_least(1, 64)    # requests held at once: sizes the compressor-state pages

    @classmethod
    def from_config(cls, cfg: Any) -> "PoolConfig":
        return parse(cls, cfg, "workload.kv_pool")

    def compressed_block_size(self, ratio: int) -> int:
        """Entries per compressed page: the page's positions / ratio, at least one."""
        return max(1, self.compressed_block_tokens // ratio)

    def state_blocks(self) -> int:
        """Compressor-state pages per ratio: a request keeps at most two (its last coff·R positions,
        one page each way of a page boundary) and a step may take two more before it commits."""
        return 4 * self.max_requests


class BlockAllocator:
    """A free list of page ids: those given back (taken again first, the last given the first taken), then
    those never handed out, in order -- counted, not listed, so a pool's size costs nothing until its
    pages are taken (a check sizes page groups of any number of pages)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._fresh = 0                  # pages _fresh..num_blocks-1 were never handed out
        self._back: list[int] = []       # pages given back, the next to take last

    @property
    def num_free(self) -> int:
        return len(self._back) + self.num_blocks - self._fresh

    def free_pages(self) -> list[int]:
        """Every free page id (a list as long as the free pages: for tests and small pools)."""
        return self._back + list(range(self._fresh, self.num_blocks))

    def take(self, n: int) -> list[int]:
        if n > self.num_free:
            raise RuntimeError(f"internal: took {n} pages with {self.num_free} free")
        back = min(n, len(self._back))
        out = [self._back.pop() for _ in range(back)]
        out += range(self._fresh, self._fresh + n - back)
        self._fresh += n - back
        return out

    def give(self, pages: list[int]) -> None:
        self._back.extend(reversed(pages))


@dataclass(frozen=True, slots=True, kw_only=True)
class RowRule:
    """Which rows of a request a page group holds, as a function of the request's length.

    per: positions per row (1: one row per token; R: one per compressed entry, closed at position jR+R-1).
    keep: positions a later step still reads behind the length (None: every row, for the request's life).
    tail_only: a step writes only the rows still kept after it (the step's other rows are read from the
    step itself); otherwise it writes every new row.
    """
    per: int = 1
    keep: int | None = None
    tail_only: bool = False

    def rows(self, length: int) -> int:
        return length // self.per

    def first_kept(self, length: int) -> int:
        """The first row any later step reads, for a request of `length` tokens."""
        return 0 if self.keep is None else max(0, length - self.keep + 1)

    def first_written(self, start: int, new_len: int) -> int:
        """The first row a step from `start` to `new_len` writes."""
        return max(self.rows(start), self.first_kept(new_len)) if self.tail_only else self.rows(start)


class PageGroup:
    """Pages of `block_size` rows and each request's block table in them."""

    def __init__(self, *, name: str, block_size: int, num_blocks: int, rule: RowRule, knob: str) -> None:
        if block_size < 1 or num_blocks < 1:
            raise ValueError(f"{name} pages: block_size and num_blocks must be >= 1, got {block_size}, {num_blocks}")
        self.name, self.block_size, self.rule, self.knob = name, block_size, rule, knob
        self.allocator = BlockAllocator(num_blocks)
        self.tables: dict[Hashable, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def live_pages(self, rid: Hashable) -> int:
        return sum(1 for b in self.tables[rid] if b >= 0)

    def missing(self, rid: Hashable, start: int, new_len: int) -> list[int]:
        """Logical pages that rows the step writes fall in and that have no physical page yet."""
        bs, table = self.block_size, self.tables[rid]
        lo = self.rule.first_written(start, new_len) // bs
        hi = cdiv(self.rule.rows(new_len), bs)
        return [p for p in range(lo, hi) if p >= len(table) or table[p] < 0]

    def take(self, rid: Hashable, want: list[int]) -> tuple[int, list[int]]:
        """Give `rid` physical pages for the logical pages `want` (`missing`); returns (old table length,
        `want`)."""
        table, old = self.tables[rid], len(self.tables[rid])
        if want and want[-1] >= len(table):
            table.extend([-1] * (want[-1] + 1 - len(table)))
        for p, b in zip(want, self.allocator.take(len(want))):
            table[p] = b
        return old, want

    def untake(self, rid: Hashable, taken: tuple[int, list[int]]) -> None:
        old, pages = taken
        table = self.tables[rid]
        self.allocator.give([table[p] for p in pages])
        for p in pages:
            table[p] = -1
        del table[old:]

    def free_behind(self, rid: Hashable, length: int) -> None:
        """Free pages wholly before the first row a later step reads."""
        table = self.tables[rid]
        for p in range(min(len(table), self.rule.first_kept(length) // self.block_size)):
            if table[p] >= 0:
                self.allocator.give([table[p]])
                table[p] = -1


@dataclass(frozen=True, slots=True, kw_only=True)
class CompressorState:
    """One compressor's rows on state pages: [slots, 2·width] float32, the candidate then the gate
    logits (+ APE) of a token position, width = coff·head_dim."""
    data: Any
    block_size: int
    width: int


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerCaches:
    """Everything one layer stores between steps, by role (rows addressed through the step plan)."""
    ratio: int                                    # the layer's compress ratio (1: SWA-only)
    swa: PagedCache                               # SWA KV rows, on `swa` pages
    compressed: PagedCache | None = None          # compressed KV rows, on `entries[ratio]` pages
    indexer_keys: PagedCache | None = None        # ratio 4: indexer keys, on `entries[4]` pages
    state: CompressorState | None = None                # the compressor's rows, on `state[ratio]` pages
    indexer_state: CompressorState | None = None        # ratio 4: the indexer compressor's rows, on `state[4]`

    def caches(self) -> tuple[PagedCache, ...]:
        return tuple(c for c in (self.swa, self.compressed, self.indexer_keys) if c is not None)

    def tensors(self) -> tuple:
        states = tuple(s.data for s in (self.state, self.indexer_state) if s is not None)
        return tuple(c.data for c in self.caches()) + states


@dataclass(slots=True)
class Reservation:
    """What `reserve` took, to return it on rollback: per group and request, what `PageGroup.take` gave."""
    taken: dict[str, dict[Hashable, tuple[int, list[int]]]] = field(default_factory=dict)


class KVPool:
    """One rank's page groups and its layers' caches on them.

    `groups` holds `swa` and, for the compress ratios present, `state{R}` and `entries{R}`."""

    def __init__(self, *, groups: dict[str, PageGroup], layers: dict[int, LayerCaches], window: int) -> None:
        self.groups, self.layers, self.window = groups, layers, window

    @property
    def swa(self) -> PageGroup:
        return self.groups["swa"]

    def state(self, ratio: int) -> PageGroup | None:
        return self.groups.get(f"state{ratio}")

    def entries(self, ratio: int) -> PageGroup | None:
        return self.groups.get(f"entries{ratio}")

    def ratios(self) -> tuple[int, ...]:
        return tuple(sorted(int(n[len("entries"):]) for n in self.groups if n.startswith("entries")))

    # ---- requests ------------------------------------------------------------------------
    def add(self, rid: Hashable) -> None:
        for g in self.groups.values():
            g.tables[rid] = []

    def release(self, rid: Hashable) -> None:
        for g in self.groups.values():
            g.allocator.give([b for b in g.tables.pop(rid) if b >= 0])

    # ---- two-phase step ------------------------------------------------------------------
    def reserve(self, spans: dict[Hashable, tuple[int, int]]) -> Reservation:
        """Take the pages `spans` (rid -> (start, new_len)) need, or raise InvalidRequest taking none."""
        missing = {name: {rid: g.missing(rid, s, n) for rid, (s, n) in spans.items()} for name, g in self.groups.items()}
        for name, g in self.groups.items():
            need = {rid: len(m) for rid, m in missing[name].items()}
            total = sum(need.values())
            if total > g.allocator.num_free:
                big = {rid: k + g.live_pages(rid) for rid, k in need.items()
                       if k + g.live_pages(rid) > g.num_blocks}
                who = ("; ".join(f"request {rid!r} needs {k} pages" for rid, k in big.items())
                       + f" of the {g.name} cache, more than the whole pool" if big
                       else f"the step needs {total} new pages of the {g.name} cache")
                raise InvalidRequest(
                    f"KV pool full: {who} ({g.allocator.num_free} of {g.num_blocks} pages of {g.block_size} rows "
                    f"free); raise workload.kv_pool.{g.knob} or shorten the request (a prefill chunk's SWA pages "
                    f"are held until the step ends). Nothing was written.")
        res = Reservation()
        for name, g in self.groups.items():
            res.taken[name] = {rid: g.take(rid, want) for rid, want in missing[name].items()}
        return res

    def rollback(self, res: Reservation) -> None:
        for name, per in res.taken.items():
            g = self.groups[name]
            for rid, taken in per.items():
                g.untake(rid, taken)

    def commit(self, lengths: dict[Hashable, int]) -> None:
        """The step's requests now have `lengths`: free every page no later step reads."""
        for g in self.groups.values():
            if g.rule.keep is not None:
                for rid, n in lengths.items():
                    g.free_behind(rid, n)

    # ---- accounting ----------------------------------------------------------------------
    def bytes_in_use(self, layer: int) -> int:
        """Bytes of `layer`'s storage in pages some request holds."""
        c = self.layers[layer]
        used = {name: g.num_blocks - g.allocator.num_free for name, g in self.groups.items()}
        total = c.swa.page_bytes * used["swa"]
        for cache in (c.compressed, c.indexer_keys):
            if cache is not None:
                total += cache.page_bytes * used[f"entries{c.ratio}"]
        for st in (c.state, c.indexer_state):
            if st is not None:
                total += st.block_size * 2 * st.width * 4 * used[f"state{c.ratio}"]
        return total


def page_groups(*, window: int, ratios, pool: PoolConfig) -> dict[str, PageGroup]:
    """The page groups of a rank whose layers have compress `ratios` (1 excluded): SWA pages keep the
    sliding window, compressor state its coff·R positions, compressed entries everything."""
    groups = {"swa": PageGroup(name="swa", block_size=pool.swa_block_size, num_blocks=pool.swa_blocks,
                               rule=RowRule(keep=window), knob="swa_blocks")}
    for r in sorted(set(ratios) - {1}):
        groups[f"entries{r}"] = PageGroup(name=f"ratio-{r} compressed", block_size=pool.compressed_block_size(r),
                                          num_blocks=pool.compressed_blocks, rule=RowRule(per=r), knob="compressed_blocks")
        reach = by_ratio(r).reach
        groups[f"state{r}"] = PageGroup(name=f"ratio-{r} compressor state", block_size=reach,
                                        num_blocks=pool.state_blocks(), rule=RowRule(keep=reach, tail_only=True),
                                        knob="max_requests")
    return groups


def step_pages(group: PageGroup, start: int, new_len: int) -> int:
    """Pages a request holds in `group` while a step takes it from `start` to `new_len` positions: those
    its last commit kept and those the step writes into (`PageGroup.missing`), freed only at the commit."""
    bs, rule = group.block_size, group.rule
    kept = (rule.first_kept(start) // bs, cdiv(rule.rows(start), bs))
    wrote = (rule.first_written(start, new_len) // bs, cdiv(rule.rows(new_len), bs))
    spans = [s for s in (kept, wrote) if s[1] > s[0]]
    if len(spans) == 2 and max(kept[0], wrote[0]) <= min(kept[1], wrote[1]):      # they overlap or touch
        return max(kept[1], wrote[1]) - min(kept[0], wrote[0])
    return sum(hi - lo for lo, hi in spans)


@dataclass(frozen=True, slots=True, kw_only=True)
class PagePeak:
    """The most pages one group holds at once over a workload's steps, and the first step (1-based) at which."""
    group: PageGroup
    pages: int
    step: int


def page_bound(group: PageGroup, length: int, step: int) -> int:
    """At most the pages a request holds in `group` at any of its steps, in closed form: one that reaches
    `length` positions in steps of at most `step` tokens holds the pages of the rows a step keeps and writes,
    within `keep + step - 1` positions (one page more where they straddle a page boundary), and never more than
    the pages of all its rows."""
    bs, rule = group.block_size, group.rule
    every = cdiv(rule.rows(length), bs)
    if rule.keep is None:
        return every
    return min(every, cdiv((rule.keep + step - 1) // rule.per + 1, bs) + 1)


def bound_pages(groups: dict[str, PageGroup], requests) -> list[PagePeak]:
    """An upper bound of `peak_pages` at a cost that does not grow with the steps: per group the sum over
    `requests` ([(length, most tokens in one of its steps)]) of `page_bound` (step 0: not a step's)."""
    return [PagePeak(group=g, pages=sum(page_bound(g, n, k) for n, k in requests), step=0) for g in groups.values()]


def peak_pages(groups: dict[str, PageGroup], steps) -> list[PagePeak]:
    """What the pool's allocator would hand out, step by step, for `steps` ([(phase, {request: new
    tokens})], an iterable, every request held from the first step to the last, as `run` holds them),
    without taking a page: per group the peak, so a pool too small for a step is found before any step
    runs. Its work grows with the steps and requests, not with the pool's pages."""
    length: dict = {}
    best = {name: PagePeak(group=g, pages=0, step=0) for name, g in groups.items()}
    for n, (_, chunk) in enumerate(steps, 1):
        for name, g in groups.items():
            # a request the step does not take holds what its last commit kept: step_pages from n to n
            held = sum(step_pages(g, length.get(r, 0), length.get(r, 0) + chunk.get(r, 0))
                       for r in length.keys() | chunk.keys())
            if held > best[name].pages:
                best[name] = PagePeak(group=g, pages=held, step=n)
        for r, k in chunk.items():
            length[r] = length.get(r, 0) + k
    return list(best.values())
