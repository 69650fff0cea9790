"""Bad input gets a clear error and harms nothing: no other request's pages, state or outputs change."""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass

import pytest
import torch

from dsv4 import oracle as ref
from dsv4.values.errors import IncompatibleCombination, InvalidRequest
from tests.conftest import chunked, drive, hidden_for, make_engine, tiny_spec


def snapshot(engine):
    """Every byte of every cache and compressor-state page, every block table, free list and length."""
    data = {(r, l, i): t.clone() for r, pool in enumerate(engine.pools) for l, c in pool.layers.items()
            for i, t in enumerate(c.tensors())}
    free = {(r, n): sorted(g.allocator.free_pages()) for r, pool in enumerate(engine.pools) for n, g in pool.groups.items()}
    tables = {(r, n): copy.deepcopy(g.tables) for r, pool in enumerate(engine.pools) for n, g in pool.groups.items()}
    return data, free, tables, {}, dict(engine.lengths)


def live_rows(engine):
    """What any request can still read: its SWA rows in the window, its compressed entries and indexer
    keys, its kept compressor-state rows -- each read through its page table."""
    out = {}
    for r, pool in enumerate(engine.pools):
        for l, c in pool.layers.items():
            for rid, n in engine.lengths.items():
                def rows(group, count, first=0, dev=c.swa.data.device):
                    g = pool.groups[group]
                    idx = torch.arange(first, count, device=dev)
                    table = torch.tensor(g.tables[rid] + [-1], device=dev)
                    page = table[(idx // g.block_size).clamp(max=len(table) - 1)]
                    return torch.where(page >= 0, page * g.block_size + idx % g.block_size, -1).int()
                swa = pool.groups["swa"]
                out[(r, l, rid, "swa")] = c.swa.read(rows("swa", n, swa.rule.first_kept(n)))
                if c.compressed is not None:
                    e = rows(f"entries{c.ratio}", n // c.ratio)
                    out[(r, l, rid, "compressed")] = c.compressed.read(e)
                    st = pool.groups[f"state{c.ratio}"]
                    s_rows = rows(f"state{c.ratio}", n, st.rule.first_kept(n)).long()
                    out[(r, l, rid, "state")] = c.state.data[s_rows]
                    if c.indexer_keys is not None:
                        out[(r, l, rid, "indexer")] = c.indexer_keys.read(e)
                        out[(r, l, rid, "indexer_state")] = c.indexer_state.data[s_rows]
    return out


def assert_unchanged(before, after):
    caches0, free0, tables0, states0, len0 = before
    caches1, free1, tables1, states1, len1 = after
    assert free0 == free1 and tables0 == tables1 and len0 == len1
    assert caches0.keys() == caches1.keys()
    assert all(torch.equal(caches0[k], caches1[k]) for k in caches0)
    assert states0.keys() == states1.keys()
    assert all(torch.equal(states0[k][0], states1[k][0]) and torch.equal(states0[k][1], states1[k][1])
               for k in states0)


def assert_rolled_back(before, rows0, eng):
    """After a step failed inside the forward: the same pages, tables, states and lengths, and every
    row any request can read unchanged (the failed step's own new slots may hold garbage)."""
    _, *rest0 = before
    _, *rest1 = snapshot(eng)
    assert all(map(_equal, rest0, rest1))          # free pages, tables, compressor states, lengths
    rows1 = live_rows(eng)
    assert rows0.keys() == rows1.keys() and all(torch.equal(rows0[k], rows1[k]) for k in rows0)


def _equal(x, y):
    if isinstance(x, dict):
        return x.keys() == y.keys() and all(_equal(x[k], y[k]) for k in x)
    if isinstance(x, tuple):
        return len(x) == len(y) and all(map(_equal, x, y))
    return torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


def started_engine(**kw):
    spec = tiny_spec(**kw.pop("spec", {}))
    eng, W = make_engine(spec, **kw)
    X = hidden_for({"a": 80, "b": 80}, spec.hidden_size)
    drive(eng, {r: X[r][:40] for r in X}, chunked({"a": 40, "b": 40}, 13))
    return spec, eng, W, X


def step(eng, chunks: dict):
    xs = torch.cat([x for x, _ in chunks.values()])
    pos = torch.cat([torch.arange(s, s + len(x)) for x, s in chunks.values()])
    ids = [r for r, (x, _) in chunks.items() for _ in range(len(x))]
    return eng.step(xs, pos, ids)


def test_bad_request_in_a_batch_is_refused_whole_and_touches_nothing():
    spec, eng, W, X = started_engine()
    eng.add_request("c")
    bad = torch.randn(5, spec.hidden_size)
    bad[2, 7] = float("nan")
    before = snapshot(eng)
    with pytest.raises(InvalidRequest, match=r"request 'c': hidden_states contain NaN"):
        step(eng, {"a": (X["a"][40:45], 40), "c": (bad, 0)})
    assert_unchanged(before, snapshot(eng))
    # a and b continue exactly as if c had never been there
    ref_eng, _ = make_engine(spec, weights=W)
    drive(ref_eng, {r: X[r][:40] for r in X}, chunked({"a": 40, "b": 40}, 13))
    o1 = step(eng, {"a": (X["a"][40:45], 40), "b": (X["b"][40:42], 40)})
    o2 = step(ref_eng, {"a": (X["a"][40:45], 40), "b": (X["b"][40:42], 40)})
    for layer in o1.outputs:
        assert torch.equal(o1.outputs[layer], o2.outputs[layer])


def test_failure_inside_the_forward_is_rolled_back():
    spec, eng, W, X = started_engine()

    @dataclass(frozen=True)
    class Boom:
        name: str = "boom"

        def plan(self, **k):
            return None

        def __call__(self, *a, **k):
            raise RuntimeError("kernel exploded")

    layer = next(l for l in eng.layers if spec.compress_ratio(l) == 4)
    kernel = eng.layers[layer][0].mqa_kernel
    eng.layers[layer][0].mqa_kernel = Boom()
    before, rows0 = snapshot(eng), live_rows(eng)
    with pytest.raises(RuntimeError, match="kernel exploded"):
        step(eng, {"a": (X["a"][40:70], 40)})      # allocates new pages and closes compressor blocks
    assert_rolled_back(before, rows0, eng)
    eng.layers[layer][0].mqa_kernel = kernel
    o = step(eng, {"a": (X["a"][40:80], 40), "b": (X["b"][40:80], 40)})
    for l, y in o.outputs.items():           # the retried step is exact against the oracle
        for rid, rows in (("a", slice(0, 40)), ("b", slice(40, 80))):
            want = ref.oracle_layer(spec.to_dump(), spec.compress_ratio(l), W[l], X[rid], row_format="float32",
                                    topk=None if l not in o.topk else torch.cat(
                                        (torch.full((40, spec.index_topk), -1), o.topk[l][rows].long())))
            assert ref.rel_err(y[rows], want["out"][40:80]) <= 1e-5


def test_request_longer_than_the_pool():
    spec, eng, W, X = started_engine(swa_blocks=40, compressed_blocks=4, compressed_block_tokens=32)
    eng.add_request("huge")
    before = snapshot(eng)
    with pytest.raises(InvalidRequest, match=r"KV pool full: request 'huge' needs 7 pages of the ratio-4 compressed cache, "
                                             r"more than the whole pool .*raise workload.kv_pool.compressed_blocks"):
        step(eng, {"huge": (torch.randn(200, spec.hidden_size), 0)})
    assert_unchanged(before, snapshot(eng))
    with pytest.raises(InvalidRequest, match=r"KV pool full: the step needs \d+ new pages of the ratio-4 compressed cache"):
        step(eng, {"a": (X["a"][40:80], 40), "huge": (torch.randn(60, spec.hidden_size), 0)})
    assert_unchanged(before, snapshot(eng))


def test_positions():
    spec, eng, W, X = started_engine(spec={"max_position_embeddings": 45})
    with pytest.raises(InvalidRequest, match=r"request 'a': positions must continue at 40 \(40..44\), got 41..45"):
        eng.step(X["a"][40:45], torch.arange(41, 46), ["a"] * 5)
    with pytest.raises(InvalidRequest, match=r"position 47 is beyond the model's range \(max_position_embeddings=45\)"):
        step(eng, {"a": (X["a"][40:48], 40)})
    step(eng, {"a": (X["a"][40:45], 40)})         # up to the last position is fine
    with pytest.raises(InvalidRequest, match=r"positions must be an integer tensor"):
        eng.step(X["b"][40:42], torch.tensor([40.0, 41.0]), ["b", "b"])


def test_unknown_and_malformed_requests():
    spec, eng, W, X = started_engine()
    before = snapshot(eng)
    with pytest.raises(InvalidRequest, match=r"unknown request 'zz' \(known: 'a', 'b'\)"):
        step(eng, {"a": (X["a"][40:42], 40), "zz": (X["b"][:2], 0)})
    with pytest.raises(InvalidRequest, match=r"request 'a': its tokens must be contiguous"):
        eng.step(X["a"][40:43], torch.tensor([40, 41, 42]), ["a", "b", "a"])
    with pytest.raises(InvalidRequest, match=r"hidden_states must be a float tensor \[T, 256\]"):
        eng.step(X["a"][40:42, :100], torch.tensor([40, 41]), ["a", "a"])
    with pytest.raises(InvalidRequest, match=r"2 entries for 3 tokens"):
        eng.step(X["a"][40:43], torch.tensor([40, 41, 42]), ["a", "a"])
    with pytest.raises(InvalidRequest, match="already exists"):
        eng.add_request("a")
    with pytest.raises(InvalidRequest, match="unknown request 'q'"):
        eng.release("q")
    assert_unchanged(before, snapshot(eng))


def test_releasing_a_request_returns_its_pages_and_leaves_others():
    spec, eng, W, X = started_engine()
    free0 = {n: g.allocator.num_free for n, g in eng.pools[0].groups.items()}
    groups = eng.pools[0].groups
    a_pages = {n: sum(b >= 0 for b in g.tables["a"]) for n, g in groups.items()}
    b_before = {n: list(g.tables["b"]) for n, g in groups.items()}
    eng.release("a")
    for n, g in groups.items():
        assert g.allocator.num_free == free0[n] + a_pages[n]
        assert "a" not in g.tables and g.tables["b"] == b_before[n]


def test_heads_not_divisible_by_tp_size_is_refused_before_building(compose_cfg, tmp_path):
    from dsv4.app.dispatch import run_config

    cfg = compose_cfg(["model=dsv4_tiny", "tp_size=3"])
    with pytest.raises(IncompatibleCombination, match=r"tp_size=3: must divide num_attention_heads=8 and o_groups=2"):
        run_config(cfg, out_dir=tmp_path)
    import json
    row = json.loads((tmp_path / "result.json").read_text())
    assert row["status"] == "incompatible" and row["problems"][0]["fix"] == "tp_size=2"


def test_non_finite_rows_are_refused_naming_layer_and_token():
    """A NaN that arises inside the layer (here: an inf weight) is never packed into a page: the step is
    refused after the forward (one read of the layers' fault flags), the failing layer's cache bytes are
    as they were, and every row any request can read is unchanged."""
    spec, eng, W, X = started_engine()
    swa_layer = next(l for l in eng.layers if spec.compress_ratio(l) == 1)
    module = eng.layers[swa_layer][0]
    kv_rows = module.w_in[spec.q_lora_rank:]             # the wkv rows of the fused input projection
    saved = kv_rows.clone()
    kv_rows[:, 3] = float("inf")
    before, rows0 = snapshot(eng), live_rows(eng)
    own = [t.clone() for t in eng.pools[0].layers[swa_layer].tensors()]
    with pytest.raises(InvalidRequest, match=rf"non-finite swa row \(layer {swa_layer}, request 'b', position 40\)"):
        step(eng, {"b": (X["b"][40:44], 40)})
    assert_rolled_back(before, rows0, eng)
    assert all(torch.equal(a, b) for a, b in zip(own, eng.pools[0].layers[swa_layer].tensors()))
    kv_rows.copy_(saved)

    c128 = next(l for l in eng.layers if spec.compress_ratio(l) == 128)
    layer = eng.layers[c128][0]
    layer.w_in[sum(layer.in_sizes[:2]) + 7] = float("nan")   # the compressor's candidate channel 7
    before, rows0 = snapshot(eng), live_rows(eng)
    with pytest.raises(InvalidRequest, match=rf"non-finite compressed row \(layer {c128}, request 'a', compressed entry 0 "
                                             r"closed at position 127\)"):
        step(eng, {"a": (torch.randn(100, spec.hidden_size), 40)})
    assert_rolled_back(before, rows0, eng)


def test_a_prompt_past_the_models_positions_is_refused_before_the_work():
    """A request whose prompt and decode steps reach past max_position_embeddings is refused by check (and so
    before `run` allocates anything), naming the request and the longest prompt that fits."""
    from dataclasses import replace

    import dsv4
    from dsv4.values.errors import IncompatibleCombination
    from dsv4.app.job import workload_problems

    base = dsv4.compose(["model=dsv4_tiny", "workload.kv_pool.swa_blocks=100",
                         "workload.kv_pool.compressed_blocks=4200"], running=False)
    fits = replace(base, workload=replace(base.workload, prompt_lens=(1048570, 5)))
    assert fits.workload.total_len(0) == 1048576
    assert workload_problems(fits) == []       # (a job this long is judged by its memory next: run's grading)
    with pytest.raises(IncompatibleCombination, match=r"request 0 reaches position 1048576.*at most 1048570 tokens"):
        dsv4.compose(["model=dsv4_tiny", "workload.prompt_lens=[1048571,5]", "workload.kv_pool.swa_blocks=100000",
                      "workload.kv_pool.compressed_blocks=100000"], running=False)


# ---- the command line, the configs, the checkpoint: one line, never a traceback ------------------------------
def cli_run(args: list[str], run_dir) -> tuple[int, str]:
    """`python run.py *args` in this process: (exit status, what it printed on stderr)."""
    import contextlib
    import io
    import sys

    from hydra.core.global_hydra import GlobalHydra

    from dsv4.app import cli

    GlobalHydra.instance().clear()
    err, argv = io.StringIO(), sys.argv
    sys.argv = ["run.py", *args, f"hydra.run.dir={run_dir}"]
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            cli.main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (err.write(str(e.code)) and 1)
    finally:
        sys.argv = argv
        GlobalHydra.instance().clear()
    return code, err.getvalue()


CHECK = ["mode=check", "model=dsv4_tiny"]
# input -> the start of its one line (each a traceback, a hang or a silent acceptance before)
BAD_CLI = [
    (["model=null"], "error: model=null: the config group model takes one of its options (dsv4_flash, dsv4_pro, "
                     "dsv4_tiny); fix: model=dsv4_flash"),
    ([*CHECK, "experiment=null"], "error: experiment=null: the config group experiment takes one of its options"),
    ([*CHECK, "=3"], "error: =3: no key before the '='; fix: KEY=3"),
    (["~model"], "error: model: missing (a ~ on the command line removed it); the job needs it, fix: model=dsv4_flash"),
    ([*CHECK, "~deployment"], "error: device: missing (a ~ on the command line removed it); the job needs it, "
                              "fix: deployment=cpu"),
    ([*CHECK, "~mqa_kernel"], "error: mqa_kernel: missing"),
    ([*CHECK, "device.arch=sm90"], "error: device.arch=sm90: a cpu device has no arch; fix: device.arch=null"),
    ([*CHECK, "deployment=h200", "device.arch=gfx942"], "error: device.arch=gfx942: not a cuda arch"),
    ([*CHECK, "workload.kv_pool=null"], "error: workload.kv_pool=null: expected a group of pool sizes"),
    ([*CHECK, "parallel=null"], "error: parallel=null: expected a group of settings; fix: leave parallel out"),
    ([*CHECK, "graph=null"], "error: graph=null: expected a group of settings"),
    ([*CHECK, "parallel.timeout_s=1e-9"], "error: parallel.timeout_s=1e-09: expected a finite number >= 1.0"),
    ([*CHECK, "parallel.timeout_s=1e300"], "error: parallel.timeout_s=1e+300: expected at most 1e+09 s"),
    ([*CHECK, "tp_size=2", "parallel.launcher=spawn", "parallel.backend=nccl"],
     "- parallel.backend=nccl: NCCL joins ranks on GPUs; this job's 2 rank processes run on the CPU"),
    ([*CHECK, "weights=checkpoint", "checkpoint.path=/nonexistent"],
     "error: checkpoint.path=/nonexistent: no such folder; fix: checkpoint.path=DIR"),
    ([*CHECK, "seed=${oops}"], "error: seed: Interpolation key 'oops' not found"),
    (["model=dsv4_tiny", "mode=${oops}"], "error: mode: Interpolation key 'oops' not found"),
]


@pytest.mark.parametrize("args,line", BAD_CLI, ids=[" ".join(a) for a, _ in BAD_CLI])
def test_bad_command_line_is_one_line_before_any_work(args, line, tmp_path):
    code, err = cli_run(args, tmp_path / "run")
    assert code == 1 and "Traceback" not in err and "HYDRA_FULL_ERROR" not in err, err[-3000:]
    assert line in err, err
    if line.startswith("error: "):
        assert err.startswith(line) and err.count("\n") <= 1, err
    assert not (tmp_path / "run" / "result.json").exists() or "mode=check" not in args


def test_ctrl_c_under_torchrun_is_said_once(monkeypatch, capsys):
    """Every rank gets the terminal's Ctrl-C: rank 0 alone says what was kept; all end with SIGINT's status."""
    from dsv4.app import cli

    for rank, says in (("1", False), ("0", True)):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as end:
            cli.stopped()
        assert end.value.code == 130 and ("interrupted:" in capsys.readouterr().err) == says


def test_a_failed_process_group_is_one_line_per_rank(monkeypatch, capsys):
    """No answer within parallel.timeout_s, or a rank gone: one line naming the setting, no traceback of
    torch.distributed's insides; the launching process names the job in one line too (RankFailed)."""
    from dsv4.app import parallel
    from dsv4.values.errors import USER_ERRORS, RankFailed

    gloo = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                        "1000ms for recv operation to complete")
    assert parallel.group_failure(gloo, 1.0) == (
        "no answer from the other ranks within parallel.timeout_s=1 s (Timed out waiting 1000ms for recv operation "
        "to complete); fix: parallel.timeout_s=60 if they were only slow, else another rank's message says why")
    peer = RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:37530")
    assert parallel.group_failure(peer, 60.0).startswith("lost the other ranks (Connection closed by peer")
    assert parallel.group_failure(RuntimeError("kernel exploded"), 60.0) is None
    monkeypatch.setattr(parallel.os, "_exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    with pytest.raises(SystemExit):
        parallel.fail_rank(1, gloo, timeout_s=1.0)
    err = capsys.readouterr().err
    assert err.startswith("rank 1 failed: no answer from the other ranks") and "Traceback" not in err
    assert issubclass(RankFailed, USER_ERRORS)


def test_torchrun_refuses_a_launcher_of_its_own(monkeypatch, compose_cfg, tmp_path):
    """Under torchrun each process is a rank: parallel.launcher=spawn would start tp_size more per rank (which
    waited on each other's ports for the whole timeout), simulated would run the job once per rank."""
    from dsv4.app.dispatch import run_config
    from dsv4.values.errors import ConfigError

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    for launcher in ("spawn", "simulated"):
        with pytest.raises(ConfigError, match=rf"parallel.launcher={launcher}: this process is one of the 2 ranks "
                                              r"torchrun started; fix: parallel.launcher=auto"):
            run_config(compose_cfg([*CHECK, "tp_size=2", f"parallel.launcher={launcher}"]), out_dir=tmp_path)


def _with_config(text: str):
    return lambda root: (root / "config.json").write_text(text)


def _with_index(text: str):
    return lambda root: (root / "model.safetensors.index.json").write_text(text)


BAD_CHECKPOINTS = [
    ("config.json a list", _with_config("[1, 2]"), "config.json: holds a JSON list, expected an object with the "
                                                   "model's settings"),
    ("config.json null", _with_config("null"), "config.json: holds a JSON null"),
    ("config.json not text", lambda root: (root / "config.json").write_bytes(b"\xff\xfe\x00"),
     "config.json: not readable JSON (UnicodeDecodeError"),
    ("config.json empty", _with_config(""), "config.json: not readable JSON (JSONDecodeError"),
    ("index a list", _with_index("[]"), "model.safetensors.index.json: holds a JSON list"),
    ("weight_map a list", _with_index('{"weight_map": [1]}'), 'not a safetensors index (needs a "weight_map": '
                                                              '{tensor: file}, has list)'),
    ("quantization_config a list", lambda root: (root / "config.json").write_text(json.dumps(
        dict(json.loads((root / "config.json").read_text()), quantization_config=[1]))),
     "quantization_config=[1] is not an object"),
    ("compress_ratios of strings", lambda root: (root / "config.json").write_text(json.dumps(
        dict(json.loads((root / "config.json").read_text()), compress_ratios=["a", "b", "c"]))),
     "compress_ratios: config.json has ['a', 'b', 'c']"),
]


@pytest.mark.parametrize("edit,message", [c[1:] for c in BAD_CHECKPOINTS], ids=[c[0] for c in BAD_CHECKPOINTS])
def test_a_bad_checkpoint_file_is_one_line(tmp_path, edit, message):
    from dsv4.components.checkpoint import load_layers
    from dsv4.values.errors import ConfigError
    from tests.test_checkpoint import spec, write_checkpoint

    root = tmp_path / "ck"
    write_checkpoint(root)
    edit(root)
    with pytest.raises(ConfigError) as e:
        load_layers(root, spec(), [1], model_choice="dsv4_tiny")
    assert message in str(e.value), str(e.value)
