"""What a `run` executes: requests with prompts, chunked prefill, then decode steps.

Prefill steps batch every request still in its prompt, `prefill_chunk` tokens each (requests of
different lengths mix, and finish at different steps); decode steps give every request
`decode_tokens` new tokens (more than one = multi-token prediction). Hidden states are seeded random,
the same for every layer (a layer bench, not a model).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dsv4.values.errors import ConfigError
from dsv4.values.settings import at_least, parse
from dsv4.values.spec import ModelSpec


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    prompt_lens: tuple[int, ...] = at_least(1)
    prefill_chunk: int = at_least(1)
    decode_steps: int = at_least(0)
    decode_tokens: int = at_least(1)
    layers: tuple[int, ...] | None = at_least(0, None)     # None: one layer of each type of the model

    @classmethod
    def from_config(cls, cfg: Any) -> "Workload":
        """The `workload:` section (its `kv_pool:` is kv_pool.PoolConfig's)."""
        w = parse(cls, cfg, "workload", skip=("kv_pool",))
        pool = (cfg or {}).get("kv_pool", {})
        if not isinstance(pool, dict):          # null would silently mean other pool sizes than the workload's
            raise ConfigError(f"workload.kv_pool={'null' if pool is None else repr(pool)}: expected a group of pool "
                              "sizes (e.g. workload.kv_pool.swa_blocks=64); fix: leave workload.kv_pool out")
        if not w.prompt_lens:
            raise ConfigError("workload.prompt_lens=[]: expected at least one request, e.g. [300,170]")
        if w.layers == ():
            raise ConfigError("workload.layers=[]: expected at least one layer index, or null (one of each type)")
        return w

    def layer_indices(self, spec: ModelSpec) -> tuple[int, ...]:
        return self.layers if self.layers is not None else spec.one_layer_per_type()

    def total_len(self, i: int) -> int:
        return self.prompt_lens[i] + self.decode_steps * self.decode_tokens

    def steps(self) -> list[tuple[str, dict[int, int]]]:
        """[(phase, {request: new tokens})] in order."""
        return list(self.iter_steps())

    def iter_steps(self):
        """`steps` one at a time: what walks them once holds one step, not all of them."""
        done = [0] * len(self.prompt_lens)
        while any(d < n for d, n in zip(done, self.prompt_lens)):
            chunk = {i: min(self.prefill_chunk, n - d) for i, (d, n) in enumerate(zip(done, self.prompt_lens)) if d < n}
            for i, k in chunk.items():
                done[i] += k
            yield "prefill", chunk
        for _ in range(self.decode_steps):
            yield "decode", {i: self.decode_tokens for i in range(len(self.prompt_lens))}

    def num_steps(self) -> int:
        """How many `steps` there are, counted without making them."""
        return -(-max(self.prompt_lens) // self.prefill_chunk) + self.decode_steps

    def max_step_tokens(self) -> int:
        """The most tokens one step holds, without making the steps: the first prefill step's (each later one
        holds no more) or a decode step's."""
        prefill = sum(min(self.prefill_chunk, n) for n in self.prompt_lens)
        return max(prefill, len(self.prompt_lens) * self.decode_tokens if self.decode_steps else 0)


@dataclass(slots=True)
class RunRecord:
    """Every processed token in processing order, and what each layer produced for it: rows of tensors
    made once for the whole workload and filled step by step (a step's copies kept in lists would sit between
    the steps' large temporaries and keep the process's freed memory from being reused)."""
    tokens_total: int = 0
    filled: int = 0
    hidden: Any = None                                  # [tokens, hidden] float32
    positions: Any = None                               # [tokens] int64
    request_index: Any = None                           # [tokens] int32
    outputs: dict = field(default_factory=dict)         # layer -> [tokens, hidden] float32
    topk: dict = field(default_factory=dict)            # ratio-4 layer -> [tokens, K] int32
    seconds: dict = field(default_factory=dict)         # (phase, layer) -> seconds
    reduce_seconds: dict = field(default_factory=dict)  # (phase, layer) -> of which in the all-reduce
    steps: dict = field(default_factory=dict)           # phase -> count
    tokens: dict = field(default_factory=dict)          # phase -> count
    pool_bytes: dict = field(default_factory=dict)      # layer -> KV bytes held at the end (rank 0)
    decode_step_s: list = field(default_factory=list)   # each decode step's seconds, its layers summed

    def put(self, x, pos, rid, outputs=None, topk=None) -> None:
        """One step's tokens (x [n, hidden], pos [n], rid [n]) and, when recorded, each layer's outputs and
        selections, at the next n rows."""
        import torch

        def rows(table, key, like, dtype):
            if key not in table:
                table[key] = torch.empty((self.tokens_total, *like.shape[1:]), dtype=dtype)
            return table[key]

        a, b = self.filled, self.filled + x.shape[0]
        cols = {"hidden": (x, torch.float32), "positions": (pos, torch.int64), "request_index": (rid, torch.int32)}
        for name, (v, dtype) in cols.items():
            if getattr(self, name) is None:
                setattr(self, name, torch.empty((self.tokens_total, *v.shape[1:]), dtype=dtype))
            getattr(self, name)[a:b] = v
        for layer, y in (outputs or {}).items():
            rows(self.outputs, layer, y, torch.float32)[a:b] = y
        for layer, t in (topk or {}).items():
            rows(self.topk, layer, t, t.dtype)[a:b] = t
        self.filled = b

    def cat(self) -> dict[str, Any]:
        n = self.filled
        return {"hidden": self.hidden[:n], "positions": self.positions[:n], "request_index": self.request_index[:n],
                "outputs": {l: v[:n] for l, v in self.outputs.items()},
                "topk": {l: v[:n] for l, v in self.topk.items()}}


def run_workload(engine, workload: Workload, *, hidden_size: int, seed: int, progress=None,
                 record: bool = True) -> RunRecord:
    """`progress(step, steps, phase, layer=None)`, if given, is called as each layer of a step starts
    (`layer` names it: "layer 2 (c4a) 2/3") and once after the step (`layer=None`). record=False keeps
    no outputs or selections (ranks other than the one that grades them): no copies to the host."""
    import torch

    from dsv4.components.engine import timer_for

    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(workload.total_len(i), hidden_size, generator=g) for i in range(len(workload.prompt_lens))]
    done = [0] * len(xs)
    rec = RunRecord(tokens_total=sum(workload.total_len(i) for i in range(len(xs))))
    for i in range(len(xs)):
        engine.add_request(i)
    steps = workload.steps()
    order = {layer: i for i, layer in enumerate(engine.layers)}
    for n_step, (phase, chunk) in enumerate(steps):
        x = torch.cat([xs[i][done[i]:done[i] + k] for i, k in chunk.items()])
        pos = torch.cat([torch.arange(done[i], done[i] + k) for i, k in chunk.items()])
        rid = [i for i, k in chunk.items() for _ in range(k)]
        on_layer = None
        if progress is not None:
            def on_layer(layer, _step=n_step + 1, _phase=phase):
                progress(_step, len(steps), _phase, f"layer {layer} ({engine.spec.layer_type(layer)}) "
                                                    f"{order[layer] + 1}/{len(order)}")
        out = engine.step(x, pos, rid, on_layer=on_layer, timer=timer_for(engine.device))
        rec.put(x, pos, torch.tensor(rid, dtype=torch.int32), out.outputs if record else None,
                out.topk if record else None)
        for layer in out.outputs:
            rec.seconds[(phase, layer)] = rec.seconds.get((phase, layer), 0.0) + out.seconds[layer]
            rec.reduce_seconds[(phase, layer)] = rec.reduce_seconds.get((phase, layer), 0.0) \
                + out.reduce_seconds.get(layer, 0.0)
        rec.steps[phase] = rec.steps.get(phase, 0) + 1
        if phase == "decode":
            rec.decode_step_s.append(sum(out.seconds[layer] for layer in out.outputs))
        rec.tokens[phase] = rec.tokens.get(phase, 0) + len(rid)
        for i, k in chunk.items():
            done[i] += k
        if progress is not None:
            progress(n_step + 1, len(steps), phase)
    rec.pool_bytes = {layer: engine.pools[0].bytes_in_use(layer) for layer in engine.layers}
    for i in range(len(xs)):
        engine.release(i)
    return rec
