"""`weights=checkpoint`: generated checkpoints in the published DeepSeek-V4 layout (names, dtypes, UE8M0
block scales, a sharded index with one layer split across shards, non-attention tensors beside them).

The generator below is written from the conventions recorded in dsv4/components/checkpoint.py's
docstring, not from the loader: e4m3 linears with one float8_e8m0fnu scale per 128×128 block
(`<linear>.scale`), bf16 norms and compressor/indexer projections, fp32 sinks and APE, `config.json`
with the model fields and `quantization_config`, `model.safetensors.index.json` over several shards.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file

from dsv4.app.dispatch import run_config
from dsv4.components import checkpoint as ckpt
from dsv4.components.weights import random_layer_weights, weight_shapes
from dsv4.values.device import DeviceInfo
from dsv4.app.dump import recompute
from dsv4.values.errors import ConfigError
from dsv4.oracle import rel_err
from dsv4.components.weights import FP8_LINEARS
from dsv4.formats.fp8_blocks import dequantize_blocks
from dsv4.strategies import DeepGemmFp8OProj, OProjWeights, ReferenceOProj, TorchFp8OProj, TritonFp8OProj
from tests.conftest import CONFIGS, ROOT, fp8_block_product, run_py, tiny_spec

# the tiny model with o_lora_rank a multiple of 128, so that wo_a's groups are whole fp8 blocks
MODEL = ["model=dsv4_tiny", "model.o_lora_rank=128"]
TINY = MODEL + ["dtype=float32", "cache_layout=float32", "workload.kv_pool.swa_block_size=8",
                "workload.kv_pool.compressed_block_tokens=32", "workload.prompt_lens=[140,33]", "workload.decode_steps=2"]
FP32 = ("attn_sink", "compressor.ape", "indexer.compressor.ape")
# layer 1's attention is split: these (and wo_a's scale, away from its weight) in shard 2, the rest in 3
LAYER1_SHARD2 = ("wq_a", "wkv", "q_norm", "wq_b", "kv_norm")


def spec():
    return tiny_spec(o_lora_rank=128)


def config_json(**changes) -> dict:
    """A config.json like deepseek-ai/DeepSeek-V4-Flash's, with the tiny model's dims."""
    m = OmegaConf.to_container(OmegaConf.load(CONFIGS / "model" / "dsv4_tiny.yaml"))
    m.pop("name")
    m["o_lora_rank"] = 128
    m["rope_scaling"] = {"type": "yarn", **m["rope_scaling"]}
    m["rope_theta"], m["compress_rope_theta"] = 10000, 160000          # ints, as published
    cfg = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "num_key_value_heads": 1,
           "vocab_size": 1024, "num_nextn_predict_layers": 1, "torch_dtype": "bfloat16", "hc_mult": 4,
           "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                   "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}, **m}
    cfg.update(changes)
    return cfg


def quantize_e4m3_ue8m0(w: torch.Tensor):
    """One power-of-two scale per 128×128 block (ceil(log2(amax/448))), stored as float8_e8m0fnu."""
    r, c = w.shape
    blocks = w.view(r // 128, 128, c // 128, 128)
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-8)
    s = torch.exp2(torch.ceil(torch.log2(amax / 448)))
    q = (blocks / s[:, None, :, None]).to(torch.float8_e4m3fn).view(r, c)
    return q, s.to(torch.float8_e8m0fnu)


def dequant_independent(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return q.float() * torch.kron(s.float(), torch.ones(128, 128))


def layer_tensors(spec_, layer: int, *, scale_suffix=".scale", scale_dtype="e8m0"):
    """{relative checkpoint name: tensor} in the published dtypes, and the float weights they hold."""
    out, want = {}, {}
    for name, w in random_layer_weights(spec_, layer, seed=7).items():
        if name in FP8_LINEARS:
            q, s = quantize_e4m3_ue8m0(w)
            out[name] = q
            base = name[: -len(".weight")]
            out[base + scale_suffix] = {"e8m0": s, "uint8": s.view(torch.uint8), "f32": s.float()}[scale_dtype]
            want[name] = dequant_independent(q, s)
        elif name in FP32:
            out[name], want[name] = w, w
        else:
            out[name] = w.bfloat16()
            want[name] = out[name].float()
    return out, want


def big(*shape):                      # non-attention tensors, larger than a layer's attention
    return torch.ones(*shape, dtype=torch.bfloat16)


def write_checkpoint(root: Path, *, config=None, prefix="layers.{l}.attn.", scale_suffix=".scale",
                     scale_dtype="e8m0", embed_rows=4096, edit=None):
    """Four shards; layer 1's attention split across shards 2 and 3; embed, MoE weights, head, MTP
    beside them. `edit(shards)` may change the tensors before they are written. Returns the
    per-layer float weights the checkpoint holds, the files' tensors and the index."""
    sp = spec()
    root.mkdir(parents=True, exist_ok=True)
    shards = {i: {} for i in (1, 2, 3, 4)}
    want = {}
    for l in (0, 1, 2):
        t, want[l] = layer_tensors(sp, l, scale_suffix=scale_suffix, scale_dtype=scale_dtype)
        for n in sorted(t):
            shard = {0: 1, 1: 2 if n.split(".")[0] in LAYER1_SHARD2 or n == "wo_a" + scale_suffix else 3, 2: 3}[l]
            shards[shard][prefix.format(l=l) + n] = t[n]
        shards[{0: 1, 1: 2, 2: 4}[l]][f"layers.{l}.ffn.shared_experts.w1.weight"] = big(512, 256)
        shards[{0: 1, 1: 2, 2: 4}[l]][f"layers.{l}.attn_norm.weight"] = big(256)
    shards[1]["embed.weight"] = big(embed_rows, 256)
    shards[4]["head.weight"] = big(1024, 256)
    shards[4]["norm.weight"] = big(256)
    mtp, _ = layer_tensors(sp, 0)
    shards[4].update({"mtp.0.attn." + n: t for n, t in mtp.items()})
    if edit is not None:
        edit(shards)
    files = {i: f"model-{i:05d}-of-00004.safetensors" for i in shards}
    weight_map = {}
    for i, tensors in shards.items():
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(root / files[i]), metadata={"format": "pt"})
        weight_map |= {k: files[i] for k in tensors}
    index = {"metadata": {"total_size": sum(v.numel() * v.element_size() for s in shards.values() for v in s.values())},
             "weight_map": weight_map}
    (root / ckpt.INDEX_FILE).write_text(json.dumps(index, indent=2))
    (root / "config.json").write_text(json.dumps(config if config is not None else config_json(), indent=2))
    return want, shards, weight_map


@pytest.fixture
def checkpoint(tmp_path):
    root = tmp_path / "DeepSeek-V4-tiny"
    want, shards, weight_map = write_checkpoint(root)
    return root, want, shards, weight_map


class Recorder:
    """Wraps safetensors.safe_open: which files were opened and which tensors' bytes were read."""

    def __init__(self, monkeypatch):
        self.opened, self.read, self.headers = [], [], []
        real = ckpt.safe_open
        rec = self

        class Handle:
            def __init__(self, path, framework="pt", **kw):
                rec.opened.append(Path(path).name)
                self.f = real(path, framework=framework, **kw)

            def __enter__(self):
                self.f.__enter__()
                return self

            def __exit__(self, *a):
                return self.f.__exit__(*a)

            def keys(self):
                return self.f.keys()

            def get_slice(self, name):
                rec.headers.append(name)
                return self.f.get_slice(name)

            def get_tensor(self, name):
                rec.read.append(name)
                return self.f.get_tensor(name)

        monkeypatch.setattr(ckpt, "safe_open", Handle)


# ---- the loaded layer is the checkpoint's layer -----------------------------------------------------

def test_run_on_a_checkpoint_equals_the_oracle_on_its_dequantized_weights(compose_cfg, tmp_path, checkpoint, capsys):
    root, want, _, _ = checkpoint
    dump = tmp_path / "dump"
    cfg = compose_cfg(TINY + ["weights=checkpoint", f"checkpoint.path={root}", f"dump_dir={dump}"])
    worst = run_config(cfg, out_dir=tmp_path)
    assert worst <= 1e-5
    out = capsys.readouterr().out
    assert f"weights: checkpoint {root}" in out and "from 3 of 4 shard(s)" in out
    # the run's weights are the checkpoint's: the fp8 linears dumped as stored (e4m3 and block scales), whose
    # dequantization is the values it ran with (compared with an independent dequantization), the rest float32
    t = load_file(str(dump / "tensors.safetensors"))
    for l in (0, 1, 2):
        names = weight_shapes(spec(), spec().compress_ratio(l))
        scales = {n.removesuffix(".weight") + ".scale" for n in names if n in FP8_LINEARS}
        assert {k[len(f"layers.{l}.attn."):] for k in t if k.startswith(f"layers.{l}.attn.")} == set(names) | scales
        for n in names:
            got = t[f"layers.{l}.attn.{n}"]
            if n in FP8_LINEARS:
                assert got.dtype == torch.float8_e4m3fn
                got = dequantize_blocks(got, t[f"layers.{l}.attn.{n.removesuffix('.weight')}.scale"])
            assert torch.equal(got, want[l][n]), (l, n)
    # and its outputs equal the oracle's on those weights, recomputed from the dump alone
    for l, res in recompute(dump).items():
        assert rel_err(res["dumped"], res["out"]) <= 1e-5, l


def test_checkpoint_weights_give_the_same_outputs_as_a_run_fed_the_dequantized_tensors(compose_cfg, tmp_path,
                                                                                       checkpoint, monkeypatch):
    """The same workload with weights=random, whose weights are replaced by the dequantized tensors:
    identical outputs."""
    root, want, _, _ = checkpoint
    a = compose_cfg(TINY + ["weights=checkpoint", f"checkpoint.path={root}", f"dump_dir={tmp_path / 'a'}"])
    run_config(a, out_dir=tmp_path / "a")
    monkeypatch.setattr(ckpt, "random_layer_weights", lambda s, l, seed: {k: v.clone() for k, v in want[l].items()})
    run_config(compose_cfg(TINY + [f"dump_dir={tmp_path / 'b'}"]), out_dir=tmp_path / "b")
    ta, tb = (load_file(str(tmp_path / d / "tensors.safetensors")) for d in ("a", "b"))
    for l in (0, 1, 2):
        assert torch.equal(ta[f"layers.{l}.outputs.attn_out"], tb[f"layers.{l}.outputs.attn_out"])


def test_tensor_parallel_ranks_on_a_checkpoint(compose_cfg, tmp_path, checkpoint):
    root, *_ = checkpoint
    worst = run_config(compose_cfg(TINY + ["weights=checkpoint", f"checkpoint.path={root}", "tp_size=2",
                                     "workload.layers=[1,2]"]), out_dir=tmp_path)
    assert worst <= 1e-5


@pytest.mark.parametrize("prefix,suffix,scale_dtype", [
    ("layers.{l}.attn.", ".scale", "uint8"),                       # raw UE8M0 exponent bytes
    ("model.layers.{l}.self_attn.", ".weight_scale_inv", "f32"),   # HF-style re-export
    ("model.layers.{l}.attn.", ".weight_scale_inv", "e8m0"),       # vLLM's runtime names
])
def test_name_and_scale_variants(tmp_path, prefix, suffix, scale_dtype):
    root = tmp_path / "ck"
    want, *_ = write_checkpoint(root, prefix=prefix, scale_suffix=suffix, scale_dtype=scale_dtype)
    got = ckpt.load_layers(root, spec(), [1, 2])
    assert got.prefixes == {1: prefix.format(l=1), 2: prefix.format(l=2)}
    for l in (1, 2):
        assert got.weights[l].keys() == want[l].keys()
        assert all(torch.equal(got.weights[l][n], want[l][n]) for n in want[l])


def test_compress_ratio_comes_from_the_checkpoint_config(checkpoint):
    root, *_ = checkpoint
    got = ckpt.load_layers(root, spec(), [0, 1, 2])
    assert got.ratios == {0: 1, 1: 4, 2: 128}
    assert set(got.weights[1]) == set(weight_shapes(spec(), 4))
    assert not any(k.startswith(("compressor.", "indexer.")) for k in got.weights[0])


# ---- the fp8 path consumes the stored bytes ---------------------------------------------------------

def fake_deep_gemm(calls: list):
    def fp8_einsum(expr, a, b, d, recipe=(1, 128, 128)):
        (x, sx), (w, sw) = a, b
        assert expr == "bhr,hdr->bhd" and recipe == (1, 128, 128)
        assert x.dtype == w.dtype == torch.float8_e4m3fn and sw.dtype == torch.float32
        calls.append((w, sw))
        d.copy_(fp8_block_product(x, sx, w, sw))

    mod = types.ModuleType("deep_gemm")
    mod.fp8_einsum = fp8_einsum
    return mod


@pytest.mark.parametrize("tp_size", [1, 2])
def test_fp8_oproj_prepare_returns_the_stored_bytes_and_scales(monkeypatch, checkpoint, tp_size):
    from dsv4.checks.catalogue import strategies
    from dsv4.components.builders import build_layer
    from dsv4.components.rope import Rope
    from dsv4.strategies import NoHeadPadding, PlainRowLayout, ReferenceMQA

    root, _, shards, _ = checkpoint
    sp = spec()
    got = ckpt.load_layers(root, sp, [1])
    stored = got.fp8[1]["wo_a.weight"]
    q_file = next(s["layers.1.attn.wo_a.weight"] for s in shards.values() if "layers.1.attn.wo_a.weight" in s)
    s_file = next(s["layers.1.attn.wo_a.scale"] for s in shards.values() if "layers.1.attn.wo_a.scale" in s)
    assert torch.equal(stored.weight.view(torch.uint8), q_file.view(torch.uint8))
    assert stored.scale.dtype == torch.float8_e8m0fnu and torch.equal(stored.scale.view(torch.uint8),
                                                                      s_file.view(torch.uint8))
    dev = DeviceInfo(platform="cpu", arch="sm90")
    G, r, K = sp.o_groups // tp_size, sp.o_lora_rank, sp.heads_per_group * sp.head_dim
    calls: list = []
    monkeypatch.setitem(sys.modules, "deep_gemm", fake_deep_gemm(calls))
    for rank in range(tp_size):
        rows = slice(rank * G * r, (rank + 1) * G * r)
        srows = slice(rank * G * r // 128, (rank + 1) * G * r // 128)
        for s in (DeepGemmFp8OProj(), TorchFp8OProj(), TritonFp8OProj()):
            st = strategies(mqa_kernel=ReferenceMQA(), o_proj=s, head_padding=NoHeadPadding(),
                            cache_layout=PlainRowLayout(name="float32", dtype="float32"))
            layer = build_layer(spec=sp, layer=1, weights=got.weights[1], rank=rank, tp_size=tp_size, strategies=st,
                                device=dev, dtype="bfloat16", fp8=got.fp8[1])
            prep = layer.o_proj_prepared
            wq, ws = prep.weight, prep.scale
            assert wq.dtype == torch.float8_e4m3fn and wq.shape == (G, r, K)
            assert torch.equal(wq.reshape(G * r, K).view(torch.uint8), q_file[rows].view(torch.uint8))
            assert ws.shape == (G, r // 128, K // 128)
            assert torch.equal(ws.reshape(-1, K // 128), s_file[srows].float())
        # DeepGEMM's call runs on exactly those bytes and scales, and computes the projection
        calls.clear()
        s = DeepGemmFp8OProj()
        w = OProjWeights(wo_a=got.weights[1]["wo_a.weight"][rows], groups=G, wo_a_fp8=stored.weight[rows],
                         wo_a_scale=stored.scale[srows])
        prep = s.prepare(w, device=dev, dtype="bfloat16")
        o = torch.randn(5, G * sp.heads_per_group, 512, generator=torch.Generator().manual_seed(rank)).bfloat16()
        rope = Rope.for_layer(sp, 4)
        y = s(o, rope.at(torch.arange(40, 45)), prepared=prep)
        (w_seen, s_seen), = calls
        assert torch.equal(w_seen.view(torch.uint8).reshape(G * r, K), q_file[rows].view(torch.uint8))
        assert torch.equal(s_seen.reshape(-1, K // 128), s_file[srows].float())
        ref = ReferenceOProj()
        y_ref = ref(o.float(), rope.at(torch.arange(40, 45)), prepared=ref.prepare(w, device=dev, dtype="float32"))
        assert rel_err(y, y_ref) <= 6e-2          # fp8 activations; the weights are the same values


@pytest.mark.parametrize("tp_size", [1, 2])
def test_fp8_linears_load_without_dequantization(checkpoint, tp_size):
    """Every fp8 linear comes back as its stored e4m3 bytes and UE8M0 scales; an fp8 `linear` option's layer
    multiplies those bytes (its buffers are the file's, shard by shard) and the memory it holds shows it."""
    from dsv4.checks.catalogue import strategies
    from dsv4.components.builders import build_layer
    from dsv4.strategies import Fp8SimLinear, NoHeadPadding, PlainRowLayout, ReferenceLinear, ReferenceMQA

    root, _, shards, _ = checkpoint
    sp = spec()
    got = ckpt.load_layers(root, sp, [1])
    assert set(got.fp8[1]) == set(FP8_LINEARS)
    file = {n: t for s in shards.values() for n, t in s.items()}
    for name, blocks in got.fp8[1].items():
        base = "layers.1.attn." + name.removesuffix(".weight")
        assert torch.equal(blocks.weight.view(torch.uint8), file[base + ".weight"].view(torch.uint8))
        assert torch.equal(blocks.scale.view(torch.uint8), file[base + ".scale"].view(torch.uint8))
    held = {}
    for lin in (ReferenceLinear(), Fp8SimLinear()):
        st = strategies(mqa_kernel=ReferenceMQA(), o_proj=ReferenceOProj(), head_padding=NoHeadPadding(),
                        cache_layout=PlainRowLayout(name="bfloat16", dtype="bfloat16"), linear=lin)
        for rank in range(tp_size):
            layer = build_layer(spec=sp, layer=1, weights=got.weights[1], rank=rank, tp_size=tp_size, strategies=st,
                                device=DeviceInfo(platform="cpu"), dtype="bfloat16", fp8=got.fp8[1])
            held[lin.name, rank] = sum(b.numel() * b.element_size() for b in layer.buffers())
            if lin.name == "fp8_sim":
                rows = sp.num_attention_heads // tp_size * sp.head_dim
                wq_b = file["layers.1.attn.wq_b.weight"][rank * rows:(rank + 1) * rows].view(torch.uint8)
                assert torch.equal(layer.wq_b[:rows].view(torch.uint8), wq_b)
                assert layer.w_in.dtype == layer.wo_b.dtype == torch.float8_e4m3fn
    for rank in range(tp_size):
        assert held["fp8_sim", rank] < held["reference", rank]


def test_random_weights_keep_quantizing_at_build_time():
    """Without stored bytes the fp8 strategies quantize wo_a themselves, as before."""
    g = torch.Generator().manual_seed(0)
    w = OProjWeights(wo_a=torch.randn(256, 1024, generator=g) / 32, groups=2)
    prep = DeepGemmFp8OProj().prepare(w, device=DeviceInfo(platform="cpu", arch="sm90"), dtype="bfloat16")
    assert prep.weight.shape == (2, 128, 1024) and prep.scale.shape == (2, 1, 8)


# ---- reading only what the layer needs --------------------------------------------------------------

def test_only_the_needed_shards_are_opened_and_only_the_layers_tensors_read(monkeypatch, checkpoint):
    root, _, _, weight_map = checkpoint
    rec = Recorder(monkeypatch)
    got = ckpt.load_layers(root, spec(), [2])
    assert rec.opened == ["model-00003-of-00004.safetensors"]      # layer 2 lives in shard 3 only
    needed = {f"layers.2.attn.{n}" for n in weight_shapes(spec(), 128)}
    needed |= {f"layers.2.attn.{n[:-len('.weight')]}.scale" for n in FP8_LINEARS if n in weight_shapes(spec(), 128)}
    assert set(rec.read) == needed and len(rec.read) == len(needed)
    assert got.stats.files_opened == rec.opened

    rec = Recorder(monkeypatch)
    got = ckpt.load_layers(root, spec(), [1])                        # split across shards 2 and 3
    assert sorted(rec.opened) == ["model-00002-of-00004.safetensors", "model-00003-of-00004.safetensors"]
    assert all(n.startswith("layers.1.attn.") for n in rec.read)
    assert not any("ffn" in n or "embed" in n for n in rec.read + rec.headers)
    files = {f: load_file(str(root / f)) for f in rec.opened}
    want_bytes = sum(files[weight_map[n]][n].numel() * files[weight_map[n]][n].element_size() for n in rec.read)
    assert got.stats.bytes_read == want_bytes
    unread = {n for t in files.values() for n in t} - set(rec.read)
    assert "layers.1.ffn.shared_experts.w1.weight" in unread and {n for n in weight_map if n.startswith("layers.2.attn.")} <= unread


def test_peak_memory_stays_near_the_layers_size(tmp_path):
    """A shard that also holds a 128 MiB embedding: loading layer 0 (whose tensors share that shard)
    raises the process's peak RSS by about the layer's size, not the shard's. Measured in a fresh
    process after a warm-up load: the peak (VmHWM) is reset before the load (Linux clear_refs 5); a
    control that touches the embedding's pages shows the measurement would see them."""
    root = tmp_path / "ck"
    write_checkpoint(root, embed_rows=256 * 1024)       # embed.weight: [262144, 256] bf16 = 128 MiB, in shard 1
    assert (root / "model-00001-of-00004.safetensors").stat().st_size > 128 * 2 ** 20
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        import torch
        from safetensors import safe_open
        from tests.conftest import tiny_spec
        from dsv4.components.checkpoint import load_layers

        def kib(key):
            return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key))

        def peak_growth(fn):
            open("/proc/self/clear_refs", "w").write("5")
            before = kib("VmRSS:")
            out = fn()
            return (kib("VmHWM:") - before) * 1024, out

        sp = tiny_spec(o_lora_rank=128)
        del load_layers({str(root)!r}, sp, [0]).weights     # warm-up: torch's first-use allocations
        grew, got = peak_growth(lambda: load_layers({str(root)!r}, sp, [0]))
        floats = sum(t.numel() * 4 for t in got.weights[0].values())
        with safe_open({str(root / "model-00001-of-00004.safetensors")!r}, framework="pt") as f:
            control, _ = peak_growth(lambda: int(f.get_tensor("embed.weight").view(-1).view(torch.uint8)[::4096].sum()))
        print(grew, got.stats.bytes_read, floats, control)
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                       check=False)
    if "clear_refs" in p.stderr:
        pytest.skip("this kernel cannot reset the peak RSS (/proc/self/clear_refs)")
    assert p.returncode == 0, p.stderr
    grew, read, floats, control = (int(x) for x in p.stdout.split())
    assert read < 2 * 2 ** 20 and floats < 8 * 2 ** 20
    print(f"peak RSS: +{grew / 2 ** 20:.1f} MiB loading the layer ({read / 2 ** 20:.1f} MiB stored, "
          f"{floats / 2 ** 20:.1f} MiB float32); +{control / 2 ** 20:.1f} MiB reading the embedding")
    assert control > 120 * 2 ** 20                       # reading the embedding would show
    assert grew < read + floats + 16 * 2 ** 20, (     # allocator slack; the embedding is 128 MiB
        f"peak RSS grew by {grew / 2 ** 20:.1f} MiB for a layer of {read / 2 ** 20:.1f} MiB stored, "
        f"{floats / 2 ** 20:.1f} MiB as float32")


# ---- clear errors -----------------------------------------------------------------------------------

def load_error(root, layers=(1,), sp=None, model="dsv4_tiny") -> str:
    with pytest.raises(ConfigError) as e:
        ckpt.load_layers(root, sp or spec(), list(layers), model_choice=model)
    return str(e.value)


def test_missing_tensor_is_named_with_where_it_was_expected(tmp_path):
    root = tmp_path / "ck"
    write_checkpoint(root, edit=lambda s: s[3].pop("layers.1.attn.indexer.wq_b.weight"))
    msg = load_error(root)
    assert "layers.1.attn.indexer.wq_b.weight is missing" in msg and ckpt.INDEX_FILE in msg
    assert "model-00002-of-00004.safetensors" in msg and "model-00003-of-00004.safetensors" in msg

    # listed in the index, absent from the shard it names
    root2 = tmp_path / "ck2"
    write_checkpoint(root2)
    idx = json.loads((root2 / ckpt.INDEX_FILE).read_text())
    idx["weight_map"]["layers.1.attn.wq_b.weight"] = "model-00004-of-00004.safetensors"
    (root2 / ckpt.INDEX_FILE).write_text(json.dumps(idx))
    msg = load_error(root2)
    assert "layers.1.attn.wq_b.weight is missing from model-00004-of-00004.safetensors" in msg

    # a scale that is not there
    root3 = tmp_path / "ck3"
    write_checkpoint(root3, edit=lambda s: s[2].pop("layers.1.attn.wkv.scale"))
    msg = load_error(root3)
    assert "layers.1.attn.wkv.weight" in msg and "block scale is missing" in msg
    assert "layers.1.attn.wkv.scale" in msg and "layers.1.attn.wkv.weight_scale_inv" in msg


def test_wrong_shape_names_the_tensor_expected_and_found(tmp_path):
    root = tmp_path / "ck"

    def edit(s):
        q, sc = quantize_e4m3_ue8m0(torch.randn(4096, 256))
        s[2]["layers.1.attn.wq_b.weight"], s[2]["layers.1.attn.wq_b.scale"] = q, sc
    write_checkpoint(root, edit=edit)
    msg = load_error(root)
    assert "layers.1.attn.wq_b.weight" in msg and "shape [4096, 256], expected [4096, 128]" in msg
    assert "model-00002-of-00004.safetensors" in msg

    root2 = tmp_path / "ck2"
    write_checkpoint(root2, edit=lambda s: s[2].__setitem__(
        "layers.1.attn.wkv.scale", torch.ones(4, 1).to(torch.float8_e8m0fnu)))
    msg = load_error(root2)
    assert "layers.1.attn.wkv.scale" in msg and "shape [4, 1], expected [4, 2]" in msg


@pytest.mark.parametrize("bad,dtype", [(float("nan"), "e8m0"), (float("inf"), "f32"), (0.0, "f32"), (-1.0, "f32")])
def test_non_finite_or_non_positive_scale_is_named(tmp_path, bad, dtype):
    root = tmp_path / "ck"

    def edit(s):
        sc = s[2]["layers.1.attn.wq_a.scale"]
        if dtype == "e8m0":
            raw = sc.view(torch.uint8).clone()
            raw[0, 1] = 255                                # UE8M0's NaN
            s[2]["layers.1.attn.wq_a.scale"] = raw.view(torch.float8_e8m0fnu)
        else:
            f = sc.float().clone()
            f[0, 1] = bad
            s[2]["layers.1.attn.wq_a.scale"] = f
    write_checkpoint(root, edit=edit)
    msg = load_error(root)
    assert "layers.1.attn.wq_a.scale" in msg and "non-finite or not positive" in msg and "block (0, 1)" in msg


def test_config_that_disagrees_with_the_model_names_field_values_and_fix(tmp_path, compose_cfg):
    root = tmp_path / "ck"
    write_checkpoint(root, config=config_json(q_lora_rank=256, index_topk=16))
    msg = load_error(root)
    assert "disagrees with model=dsv4_tiny" in msg
    assert "q_lora_rank: config.json has 256, model=dsv4_tiny has 128" in msg
    assert "index_topk: config.json has 16, model=dsv4_tiny has 8" in msg
    assert "fix: model.q_lora_rank=256 model.index_topk=16" in msg

    # the published Flash config.json against the tiny model: the fix names the preset
    flash = OmegaConf.to_container(OmegaConf.load(CONFIGS / "model" / "dsv4_flash.yaml"))
    flash.pop("name")
    root2 = tmp_path / "flash"
    root2.mkdir()
    (root2 / "config.json").write_text(json.dumps(config_json(**flash)))
    (root2 / ckpt.INDEX_FILE).write_text(json.dumps({"weight_map": {}}))
    msg = load_error(root2)
    assert "hidden_size: config.json has 4096, model=dsv4_tiny has 256" in msg and "fix: model=dsv4_flash" in msg

    # through the app: a ConfigError, which the CLI prints without a traceback
    cfg = config_json()
    cfg["rope_scaling"]["factor"] = 40
    root3 = tmp_path / "ck3"
    write_checkpoint(root3, config=cfg)
    with pytest.raises(ConfigError, match="rope_scaling.factor: config.json has 40, model=dsv4_tiny has 16.0"):
        run_config(compose_cfg(TINY + ["weights=checkpoint", f"checkpoint.path={root3}"]), out_dir=tmp_path / "o")


def test_ratio_in_config_that_contradicts_the_tensors(tmp_path):
    """config.json (and the model) say layer 1 is ratio 128, the checkpoint holds a ratio-4 layer there."""
    root = tmp_path / "ck"
    cfg = config_json(compress_ratios=[0, 128, 128, 0])
    write_checkpoint(root, config=cfg)
    msg = load_error(root, layers=(1,), sp=tiny_spec(o_lora_rank=128, compress_ratios=[0, 128, 128, 0]))
    assert "layers.1.attn.indexer." in msg and "layer 1's compress ratio is 128" in msg


def test_a_bf16_wo_a_is_used_as_stored(tmp_path):
    """A checkpoint converted for DeepSeek's reference code holds wo_a in bf16, without a scale."""
    root = tmp_path / "ck"

    def edit(s):
        s[3]["layers.1.attn.wo_a.weight"] = s[3]["layers.1.attn.wo_a.weight"].float().bfloat16()
        del s[2]["layers.1.attn.wo_a.scale"]
    write_checkpoint(root, edit=edit)
    got = ckpt.load_layers(root, spec(), [1])
    assert "wo_a.weight" not in got.fp8[1] and "stored as torch.bfloat16" in " ".join(got.notes)
    assert got.weights[1]["wo_a.weight"].dtype == torch.float32


def test_dequantize_partial_blocks():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(200, 300, generator=g).to(torch.float8_e4m3fn)
    s = torch.exp2(torch.randint(-6, 3, (2, 3), generator=g).float()).to(torch.float8_e8m0fnu)
    want = q.float() * torch.kron(s.float(), torch.ones(128, 128))[:200, :300]
    assert torch.equal(ckpt.dequantize(q, s, (128, 128)), want)


@pytest.mark.parametrize("overrides,match", [
    (["weights=checkpoint"], "weights=checkpoint needs the checkpoint folder: checkpoint.path=DIR"),
    (["weights=checkpoint", "checkpoint.path=/nonexistent/DeepSeek-V4-Flash"], "no such folder"),
    (["weights=pretrained"], "weights=pretrained: expected one of random, checkpoint"),
])
def test_missing_path_and_unknown_source(compose_cfg, tmp_path, overrides, match):
    with pytest.raises(ConfigError, match=match):
        run_config(compose_cfg(TINY + overrides), out_dir=tmp_path)


def test_folder_without_index_or_config(tmp_path):
    (tmp_path / "empty").mkdir()
    assert "no config.json" in load_error(tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text(json.dumps(config_json()))
    assert "neither model.safetensors.index.json nor model.safetensors" in load_error(tmp_path / "empty")


def test_cli_prints_the_error_without_a_traceback(tmp_path):
    p = run_py(*MODEL, "weights=checkpoint", f"checkpoint.path={tmp_path / 'nope'}", run_dir=tmp_path, timeout=300)
    assert p.returncode == 1
    assert "error: checkpoint.path=" in p.stderr and "no such folder" in p.stderr
    assert "Traceback" not in p.stderr


def test_single_file_checkpoint(tmp_path):
    """A checkpoint without an index: one model.safetensors."""
    sp = spec()
    t, want = layer_tensors(sp, 2)
    root = tmp_path / "one"
    root.mkdir()
    save_file({f"layers.2.attn.{k}": v for k, v in t.items()} | {"embed.weight": big(64, 256)},
              str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps(config_json()))
    got = ckpt.load_layers(root, sp, [2])
    assert all(torch.equal(got.weights[2][n], want[n]) for n in want)
    assert math.isclose(got.stats.bytes_read, sum(v.numel() * v.element_size() for v in t.values()))


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_damaged_shard_is_named_with_what_is_wrong(checkpoint, damage):
    """A shard cut short (an interrupted download) or overwritten is a one-line error that names the file,
    not safetensors' own exception from inside the loader."""
    root = checkpoint[0]
    shard = root / "model-00003-of-00004.safetensors"                 # layer 2's attention
    data = shard.read_bytes()
    shard.write_bytes(data[:len(data) // 2] if damage == "truncated" else b"\x07" * len(data))
    msg = load_error(root, layers=(2,))
    assert "model-00003-of-00004.safetensors" in msg and "not a readable safetensors file" in msg
    assert "truncated or corrupt" in msg and "\n" not in msg
