"""`weights=checkpoint`: one layer's attention tensors read from a published DeepSeek-V4 checkpoint.

What is read. The checkpoint folder's `config.json` (compared with the chosen `model=`) and its
`model.safetensors.index.json` (or a single `model.safetensors`); then only the shards that hold the
requested layers' attention tensors are opened (`safetensors.safe_open`, memory-mapped), and only those
tensors are read — never the embedding, the MoE experts or another layer. Every tensor's shape is
checked against `weight_shapes()` from the file header before its bytes are read.

What comes back. Per layer, the float32 tensors under our names (relative to `layers.{l}.attn.`, exactly
the names `weight_shapes()` lists for the layer's compress ratio): fp8 linears dequantized with their
block scales, bf16/fp32 tensors converted. For every fp8 linear stored in 128x128 blocks also its e4m3
bytes and block scales unchanged (`Fp8Blocks`), which the fp8 `linear` and `o_proj` options consume as
they are (no dequantize-requantize round trip); the float copy then serves the float options and the
oracle.

Checkpoint conventions, and where they come from (read 2026; no real checkpoint is reachable here):

* Names. DeepSeek publishes DeepSeek-V4-Flash/-Pro under its own module names, a decoder layer's
  attention under `layers.{l}.attn.` (`wq_a.weight`, `wkv.weight`, `q_norm.weight`, `wq_b.weight`,
  `kv_norm.weight`, `wo_a.weight`, `wo_b.weight`, `attn_sink`, `compressor.{wkv,wgate}.weight`,
  `compressor.ape`, `compressor.norm.weight`, `indexer.{wq_b,weights_proj}.weight`,
  `indexer.compressor.*`), the MTP layer under `mtp.0.`, plus `embed.weight`, `head.weight`,
  `norm.weight`, `hc_head_*`. Sources: a tensor census of deepseek-ai/DeepSeek-V4-Flash (46 shards
  `model-000NN-of-00046.safetensors`, 69,187 tensors; found in the code index with
  find_string "attn.wo_a.scale"), vLLM's `_make_deepseek_v4_weights_mapper`
  (vllm/models/deepseek_v4/nvidia/model.py: maps checkpoint `layers.` -> its runtime `model.layers.`,
  `embed.`/`norm.`/`head.weight`/`mtp.`), and DeepSeek's reference `inference/model.py` (copy in
  foreverlasting1202/DeepSeek-V4-Deconstruction-Lab, DeepSeek_official/model.py: `Block.attn`).
  Re-exports in the Hugging Face / Megatron style put the same leaf names under
  `model.layers.{l}.self_attn.` (e.g. the Megatron-bridge DSV4 mapping
  `decoder.layers.*.self_attention.wo_a.weight` <-> `model.layers.*.self_attn.wo_a.weight`), and vLLM's
  runtime names are `model.layers.{l}.attn.`. The sources disagree only between published files and
  re-exports, so all three prefixes are accepted (`PREFIXES`); the one a layer's `wkv.weight` is
  found under is used for all of that layer's tensors.
* Block scales. Published: `<linear>.scale` beside `<linear>.weight` (e.g. `layers.0.attn.wq_a.scale`),
  dtype `float8_e8m0fnu` (UE8M0: a power of two, byte = exponent + 127, 0xFF = NaN), shape
  [ceil(out/128), ceil(in/128)] (census: wq_a [1024, 4096] e4m3 with scale [8, 32]; wo_a [8192, 4096]
  with [64, 32]; indexer.wq_b [8192, 1024] with [64, 8]); the scale multiplies (reference `linear()`:
  `fp8_gemm(x, s, weight, weight.scale)`; `Linear` allocates `scale` as float8_e8m0fnu with
  ceil(dim/128) blocks). config.json: `quantization_config = {quant_method: fp8, fmt: e4m3,
  scale_fmt: ue8m0, weight_block_size: [128, 128], activation_scheme: dynamic}`. vLLM renames
  `.scale` to `.weight_scale_inv` (its Fp8LinearMethod parameter, the name DeepSeek-V3's HF checkpoint
  used; it also multiplies), and its DSV4 loader tests feed scales as float8_e8m0fnu, uint8 (the raw
  exponent bytes) or float32. Accepted here: both names (`SCALE_SUFFIXES`) and those three dtypes;
  the block size comes from `weight_block_size` (default [128, 128]) and the scale's shape must match it.
* Which tensors are fp8. e4m3 with block scales: `wq_a`, `wkv`, `wq_b`, `wo_a`, `wo_b`,
  `indexer.wq_b` (census; the reference notes "wo_a is FP8 in checkpoint" and its convert step
  dequantizes it to bf16 for its own bf16 einsum). bf16: `q_norm`, `kv_norm`, `compressor.{wkv,wgate}`,
  `compressor.norm`, `indexer.weights_proj`, `indexer.compressor.{wkv,wgate,norm}`. fp32: `attn_sink`,
  `compressor.ape`, `indexer.compressor.ape`. The loader keys on the stored dtype, not on this list: an
  e4m3 tensor must have a scale; a float tensor (e.g. a bf16 wo_a from such a convert step) is used as
  it is, and then there are no stored fp8 bytes for the fp8 o_proj strategies to take.
* The model. `config.json` carries every ModelSpec field but `name` under the same keys (census copy of
  the Flash config.json: hidden_size 4096, num_hidden_layers 43, ..., compress_ratios with 44 entries,
  rope_scaling {type: yarn, factor 16, original_max_position_embeddings 65536, beta_fast 32,
  beta_slow 1}); each one present is compared with the chosen `model=` and a layer's compress ratio is
  max(1, compress_ratios[l]) from it (vLLM's rule, docs/numerics.md §1.1).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from dsv4.components.weights import FP8_LINEARS, in_fp8_blocks, random_layer_weights, weight_shapes
from dsv4.values.errors import ConfigError
from dsv4.formats.fp8_blocks import BLOCK as FP8_BLOCK
from dsv4.formats.fp8_blocks import Fp8Blocks, LinearNumerics
from dsv4.values.spec import ModelSpec

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
PREFIXES = ("layers.{l}.attn.", "model.layers.{l}.self_attn.", "model.layers.{l}.attn.")   # published first
SCALE_SUFFIXES = (".scale", ".weight_scale_inv")         # on the linear: `wq_a.scale` | `wq_a.weight_scale_inv`
DEFAULT_BLOCK = (128, 128)
FP8_STORED = frozenset(FP8_LINEARS)            # what DeepSeek's checkpoints store as e4m3 blocks

_FLOAT = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_SCALE_DTYPES = (torch.float8_e8m0fnu, torch.float32)       # uint8 is viewed as float8_e8m0fnu


@dataclass(slots=True)
class LoadStats:
    shards_total: int
    files_opened: list[str] = field(default_factory=list)
    tensors_read: list[str] = field(default_factory=list)
    bytes_read: int = 0


@dataclass(slots=True)
class LoadedLayers:
    weights: dict[int, dict[str, torch.Tensor]]      # our names -> float32 (dequantized)
    fp8: dict[int, dict[str, Fp8Blocks]]             # our names -> the stored e4m3 128x128 blocks
    ratios: dict[int, int]
    prefixes: dict[int, str]
    stats: LoadStats
    notes: list[str] = field(default_factory=list)

    def summary(self, path: Path) -> str:
        s = self.stats
        layers = ", ".join(f"{l} (ratio {self.ratios[l]}, {self.prefixes[l]}*)" for l in self.weights)
        kept = sorted({n.removesuffix(".weight") for names in self.fp8.values() for n in names})
        fp8 = (f"  {', '.join(kept)} kept as stored (e4m3 + 128x128 block scales) for the fp8 linear and o_proj "
               f"options; dequantized to float32 for the others and the oracle")
        head = (f"  weights: checkpoint {path}: layers {layers}; read {len(s.tensors_read)} tensors, "
                f"{s.bytes_read / 2 ** 20:.1f} MiB, from {len(s.files_opened)} of {s.shards_total} shard(s)")
        lines = [head]
        if kept:
            lines.append(fp8)
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])


# ---- the checkpoint folder -------------------------------------------------------------------------


def unreadable(file: Path, e: Exception) -> ConfigError:
    """A shard safetensors cannot read, named with what is wrong (a truncated or corrupt download)."""
    size = file.stat().st_size if file.exists() else 0
    return ConfigError(f"{file}: not a readable safetensors file ({size} bytes; {type(e).__name__}: {e}); "
                        f"a truncated or corrupt download? fetch the file again")

def _json_object(file: Path, what: str) -> dict[str, Any]:
    """A JSON file of the checkpoint that must hold one object, read; anything else is named in one line."""
    try:
        value = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{file}: not readable JSON ({type(e).__name__}: {e}); fetch the file again") from None
    if not isinstance(value, dict):
        kind = "null" if value is None else {list: "list", str: "string", bool: "true/false"}.get(type(value), "number")
        raise ConfigError(f"{file}: holds a JSON {kind}, expected an object with {what}; fetch the file again")
    return value


class Checkpoint:
    """A checkpoint folder: its config.json and where each tensor lives (from the index)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(str(path)).expanduser()
        if not self.path.exists():
            raise ConfigError(f"checkpoint.path={path}: no such folder")
        if not self.path.is_dir():
            raise ConfigError(f"checkpoint.path={path}: not a folder (give the folder that holds config.json "
                              f"and {INDEX_FILE})")
        cfg = self.path / "config.json"
        if not cfg.is_file():
            raise ConfigError(f"checkpoint.path={path}: no config.json there")
        self.config: dict[str, Any] = _json_object(cfg, "the model's settings ({\"hidden_size\": ...})")
        index = self.path / INDEX_FILE
        if index.is_file():
            self.index_name = INDEX_FILE
            wm = _json_object(index, "a safetensors index ({\"weight_map\": {tensor: file}})").get("weight_map")
            if not isinstance(wm, dict):
                raise ConfigError(f"{index}: not a safetensors index (needs a \"weight_map\": {{tensor: file}}, "
                                  f"has {type(wm).__name__ if wm is not None else 'none'}); fetch the file again")
            self.weight_map: dict[str, str] = {str(k): str(v) for k, v in wm.items()}
        elif (self.path / SINGLE_FILE).is_file():
            self.index_name = SINGLE_FILE
            try:
                with safe_open(str(self.path / SINGLE_FILE), framework="pt") as f:
                    self.weight_map = {k: SINGLE_FILE for k in f.keys()}  # noqa: SIM118 (a safe_open handle)
            except Exception as e:
                raise unreadable(self.path / SINGLE_FILE, e) from e
        else:
            raise ConfigError(f"checkpoint.path={path}: neither {INDEX_FILE} nor {SINGLE_FILE} is there")
        self.shards = sorted(set(self.weight_map.values()))

    def where(self, name: str) -> str | None:
        return self.weight_map.get(name)


# ---- config.json against the chosen model ----------------------------------------------------------

def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
    return a == b


def config_mismatches(config: dict[str, Any], spec: ModelSpec) -> list[tuple[str, Any, Any]]:
    """(field, value in config.json, value in the spec) for every ModelSpec field config.json has."""
    out = []
    for f in fields(ModelSpec):
        if f.name == "name" or config.get(f.name) is None:
            continue
        got, mine = config[f.name], getattr(spec, f.name)
        if f.name == "rope_scaling":
            if not isinstance(got, dict):
                out.append(("rope_scaling", got, "yarn " + str(mine)))
                continue
            for k in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow"):
                if k in got and not _same(got[k], getattr(mine, k)):
                    out.append((f"rope_scaling.{k}", got[k], getattr(mine, k)))
        elif f.name == "compress_ratios":
            numbers = isinstance(got, list) and all(isinstance(r, (int, float)) and not isinstance(r, bool)
                                                    for r in got)
            if not numbers or list(got) != list(mine):
                out.append(("compress_ratios", got, list(mine)))
        elif not _same(got, mine):
            out.append((f.name, got, mine))
    return out


def _override(field_name: str, value: Any) -> str:
    if isinstance(value, list):
        value = "[" + ",".join(str(v) for v in value) + "]"
    return f"model.{field_name}={value}"


def _matching_models(config: dict[str, Any]) -> list[str]:
    """Model presets (configs/model/*.yaml) that config.json agrees with on every field it has."""
    from dsv4.checks.catalogue import model_presets

    return [name for name, spec in model_presets().items() if not config_mismatches(config, spec)]


def check_config(ck: Checkpoint, spec: ModelSpec, model_choice: str) -> None:
    bad = config_mismatches(ck.config, spec)
    if bad:
        lines = [f"checkpoint {ck.path}/config.json disagrees with model={model_choice}:"]
        lines += [f"  - {f}: config.json has {got}, model={model_choice} has {mine}" for f, got, mine in bad]
        presets = _matching_models(ck.config)
        overrides = " ".join(_override(f, got) for f, got, _ in bad)
        if presets:
            lines.append(f"  fix: model={presets[0]}" + (f" (or override: {overrides})" if len(bad) <= 3 else ""))
        else:
            lines.append(f"  fix: {overrides}")
        raise ConfigError("\n".join(lines))
    q = ck.config.get("quantization_config")
    if q is not None and not isinstance(q, dict):
        raise ConfigError(f"checkpoint {ck.path}/config.json: quantization_config={json.dumps(q)[:80]} is not an "
                          f"object (read: {{\"quant_method\": \"fp8\", \"fmt\": \"e4m3\", ...}}); fetch the file again")
    if isinstance(q, dict) and (q.get("quant_method", "fp8") != "fp8" or q.get("fmt", "e4m3") != "e4m3"):
        raise ConfigError(f"checkpoint {ck.path}/config.json: quantization_config {q} is not supported "
                              f"(read: fp8 e4m3 with block scales, as DeepSeek-V4-Flash/-Pro publish)")


def block_size(config: dict[str, Any]) -> tuple[int, int]:
    q = config.get("quantization_config")
    b = q.get("weight_block_size") if isinstance(q, dict) else None
    if b is None:
        return DEFAULT_BLOCK
    if not (isinstance(b, list) and len(b) == 2 and all(isinstance(x, int) and x > 0 for x in b)):
        raise ConfigError(f"config.json: quantization_config.weight_block_size={b}: expected [rows, cols]")
    return int(b[0]), int(b[1])


def layer_ratio(config: dict[str, Any], spec: ModelSpec, layer: int) -> int:
    spec.compress_ratio(layer)           # range check against the model, with its message
    ratios = config.get("compress_ratios")
    if isinstance(ratios, list) and layer < len(ratios):
        return max(1, int(ratios[layer]))
    return spec.compress_ratio(layer)


# ---- one layer -------------------------------------------------------------------------------------

@dataclass(slots=True)
class _Want:
    ours: str                     # our name, relative to layers.{l}.attn.
    name: str                     # the checkpoint's name
    shape: tuple[int, ...]
    scale: str | None = None      # the block scale's checkpoint name, when the index has one


def _prefix(ck: Checkpoint, layer: int) -> str:
    for p in PREFIXES:
        pre = p.format(l=layer)
        if ck.where(pre + "wkv.weight") is not None:
            return pre
    tried = ", ".join(p.format(l=layer) + "wkv.weight" for p in PREFIXES)
    raise ConfigError(f"checkpoint {ck.path}: layer {layer}'s attention is missing: none of {tried} is in "
                      f"{ck.index_name}")


def _plan(ck: Checkpoint, spec: ModelSpec, layer: int, ratio: int) -> tuple[str, list[_Want]]:
    pre = _prefix(ck, layer)
    wants = []
    for ours, shape in weight_shapes(spec, ratio).items():
        name = pre + ours
        w = _Want(ours=ours, name=name, shape=tuple(shape))
        if ck.where(name) is None:
            files = sorted({ck.weight_map[k] for k in ck.weight_map if k.startswith(pre)})
            raise ConfigError(f"{name} is missing: it is not in {ck.path / ck.index_name} (layer {layer}, "
                              f"compress ratio {ratio}; the layer's other attention tensors are in "
                              f"{', '.join(files)})")
        if ours.endswith(".weight"):
            base = name[: -len(".weight")]
            w.scale = next((base + s for s in SCALE_SUFFIXES if ck.where(base + s) is not None), None)
        wants.append(w)
    # a compressor or indexer the config's ratio does not have: the ratio list and the weights disagree
    extra = sorted(k for k in ck.weight_map if k.startswith(pre) and k.split(pre, 1)[1].split(".")[0] in
                   ("compressor", "indexer") and k[len(pre):] not in {x.ours for x in wants}
                   and not any(k == x.scale for x in wants))
    if extra:
        raise ConfigError(f"checkpoint {ck.path}: {extra[0]} is in the index, but layer {layer}'s compress ratio "
                          f"is {ratio} (config.json compress_ratios[{layer}]), which has no such tensor")
    return pre, wants


def _shape(f, name: str) -> tuple[int, ...]:
    """From the file's header: no tensor bytes are read."""
    return tuple(int(x) for x in f.get_slice(name).get_shape())


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """e4m3 [rows, cols] times its block scales [ceil(rows/b0), ceil(cols/b1)] -> float32."""
    (r, c), (b0, b1) = weight.shape, block
    s = scale.float()
    if r % b0 == 0 and c % b1 == 0:
        return (weight.float().view(r // b0, b0, c // b1, b1) * s[:, None, :, None]).view(r, c)
    return weight.float() * s.repeat_interleave(b0, 0)[:r].repeat_interleave(b1, 1)[:, :c]


def _check_scale(name: str, file: str, s: torch.Tensor) -> torch.Tensor:
    if s.dtype == torch.uint8:             # raw UE8M0 exponent bytes
        s = s.view(torch.float8_e8m0fnu)
    if s.dtype not in _SCALE_DTYPES:
        raise ConfigError(f"{name} in {file}: dtype {s.dtype} is not a block-scale dtype (float8_e8m0fnu, uint8 "
                          f"UE8M0 bytes or float32)")
    v = s.float()
    bad = ~(torch.isfinite(v) & (v > 0))
    if bool(bad.any()):
        i = [int(x) for x in bad.nonzero()[0]]
        raise ConfigError(f"{name} in {file}: {int(bad.sum())} block scale(s) are non-finite or not positive, "
                          f"the first at block {tuple(i)} = {float(v[tuple(i)])}")
    return s


def _read_layer(ck: Checkpoint, layer: int, ratio: int, wants: list[_Want], block: tuple[int, int],
                spec: ModelSpec, stats: LoadStats) -> tuple[dict[str, torch.Tensor], dict[str, Fp8Blocks], list[str]]:
    """The layer's tensors read as stored, then each made float32 under our name; the e4m3 ones in whole
    128x128 blocks also kept as stored, with a note for each linear the fp8 options cannot take as stored."""
    raw, where = _read_stored(ck, wants, stats, f"model={spec.name}, layer {layer}, compress ratio {ratio}")
    out: dict[str, torch.Tensor] = {}
    stored: dict[str, Fp8Blocks] = {}
    notes: list[str] = []
    for w in wants:
        out[w.ours], kept, said = _as_float32(ck, w, raw, where, block, layer, spec)
        if kept is not None:
            stored[w.ours] = kept
        notes += said
    return out, stored, notes


def _read_stored(ck: Checkpoint, wants: list[_Want], stats: LoadStats,
                 what: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every wanted tensor and block scale as stored, a shard at a time; and the shard each came from."""
    by_file: dict[str, list[str]] = {}
    for w in wants:
        for n in (w.name, w.scale):
            if n is not None:
                by_file.setdefault(ck.weight_map[n], []).append(n)
    raw: dict[str, torch.Tensor] = {}
    where: dict[str, str] = {}
    shape_of = {w.name: w.shape for w in wants}
    for file, names in by_file.items():
        got = _read_shard(ck, file, names, shape_of, stats, what)
        raw |= got
        where |= dict.fromkeys(got, file)
    return raw, where


def _read_shard(ck: Checkpoint, file: str, names: list[str], shape_of: dict[str, tuple[int, ...]],
                stats: LoadStats, what: str) -> dict[str, torch.Tensor]:
    """`names` from one shard, each shape checked against `shape_of` from the header before its bytes are
    read (`what`: the model, layer and ratio the shapes are for)."""
    fp = ck.path / file
    if not fp.is_file():
        raise ConfigError(f"{ck.path / ck.index_name} puts {names[0]} in {file}, which is not in {ck.path}")
    if file not in stats.files_opened:
        stats.files_opened.append(file)
    got: dict[str, torch.Tensor] = {}
    try:
        with safe_open(str(fp), framework="pt") as f:
            held = set(f.keys())
            for n in names:
                if n not in held:
                    raise ConfigError(f"{n} is missing from {file} (where {ck.index_name} puts it)")
                shape = _shape(f, n)
                if n in shape_of and shape != shape_of[n]:
                    raise ConfigError(f"{n} in {file}: shape {list(shape)}, expected {list(shape_of[n])} ({what})")
                t = got[n] = f.get_tensor(n)
                stats.tensors_read.append(n)
                stats.bytes_read += t.numel() * t.element_size()
    except ConfigError:
        raise
    except Exception as e:         # safetensors' own errors: a truncated or corrupt download
        raise unreadable(fp, e) from e
    return got


def _as_float32(ck: Checkpoint, w: _Want, raw: dict[str, torch.Tensor], where: dict[str, str],
                block: tuple[int, int], layer: int,
                spec: ModelSpec) -> tuple[torch.Tensor, Fp8Blocks | None, list[str]]:
    """One wanted tensor as float32 (e4m3 dequantized by its block scales, a float one converted), the e4m3
    blocks as stored where the fp8 options can take them, and the notes on what they cannot."""
    t, file = raw[w.name], where[w.name]
    kept, notes = None, []
    if t.dtype == torch.float8_e4m3fn:
        s = _block_scale(ck, w, raw, where, block)
        f32 = dequantize(t, s, block)
        whole = block == (FP8_BLOCK, FP8_BLOCK) and w.shape[0] % FP8_BLOCK == 0 and w.shape[1] % FP8_BLOCK == 0
        if whole:
            kept = Fp8Blocks(weight=t, scale=s)
        notes = _fp8_notes(w, whole, block, layer, spec)
    elif t.dtype in _FLOAT:
        f32 = t.float()
        if w.ours in FP8_STORED:
            notes.append(f"layer {layer}: {w.name} is stored as {t.dtype} (not e4m3): the fp8 linear and o_proj "
                         f"options quantize it at build time")
    else:
        raise ConfigError(f"{w.name} in {file}: dtype {t.dtype} is not read here (fp8 e4m3 with block scales, "
                          f"bf16, fp16 or fp32)")
    bad = ~torch.isfinite(f32)
    if bool(bad.any()):
        raise ConfigError(f"{w.name} in {file}: {int(bad.sum())} non-finite value(s)")
    return f32, kept, notes


def _block_scale(ck: Checkpoint, w: _Want, raw: dict[str, torch.Tensor], where: dict[str, str],
                 block: tuple[int, int]) -> torch.Tensor:
    """An e4m3 tensor's block scales, checked: present, of a scale dtype, finite and positive, one a block."""
    if w.scale is None:
        names = " nor ".join(w.name[: -len(".weight")] + s for s in SCALE_SUFFIXES)
        raise ConfigError(f"{w.name} in {where[w.name]} is float8_e4m3fn but its block scale is missing: neither "
                          f"{names} is in {ck.index_name}")
    s = _check_scale(w.scale, where[w.scale], raw[w.scale])
    want_s = (math.ceil(w.shape[0] / block[0]), math.ceil(w.shape[1] / block[1]))
    if tuple(s.shape) != want_s:
        raise ConfigError(f"{w.scale} in {where[w.scale]}: shape {list(s.shape)}, expected {list(want_s)} "
                          f"(one scale per {block[0]}x{block[1]} block of {w.name} {list(w.shape)})")
    return s


def _fp8_notes(w: _Want, whole: bool, block: tuple[int, int], layer: int, spec: ModelSpec) -> list[str]:
    """Why the fp8 options would quantize an e4m3 linear again: blocks not whole 128x128 ones, or (wo_a)
    output groups that split a block."""
    notes = []
    if not whole:
        notes.append(f"layer {layer}: {w.name} is stored in {block[0]}x{block[1]} blocks of a "
                     f"{list(w.shape)} weight; the fp8 options take whole 128x128 blocks, so they would "
                     f"quantize the dequantized weight again")
    if w.ours == "wo_a.weight" and whole and (w.shape[0] // spec.o_groups) % FP8_BLOCK:
        notes.append(f"layer {layer}: {w.name} has {w.shape[0] // spec.o_groups} rows per output group; "
                     f"fp8 o_proj strategies need each group's rows in whole 128x128 blocks, so they would "
                     f"quantize the dequantized weight again")
    return notes


def load_layers(path: str | Path, spec: ModelSpec, layers, *, model_choice: str | None = None) -> LoadedLayers:
    """Read the attention tensors of `layers` from the checkpoint at `path` (see the module docstring)."""
    ck = Checkpoint(path)
    check_config(ck, spec, model_choice or spec.name)
    block = block_size(ck.config)
    stats = LoadStats(shards_total=len(ck.shards))
    res = LoadedLayers(weights={}, fp8={}, ratios={}, prefixes={}, stats=stats)
    for l in layers:
        ratio = layer_ratio(ck.config, spec, int(l))
        pre, wants = _plan(ck, spec, int(l), ratio)
        w, stored, notes = _read_layer(ck, int(l), ratio, wants, block, spec, stats)
        res.weights[int(l)], res.ratios[int(l)], res.prefixes[int(l)] = w, ratio, pre
        if stored:
            res.fp8[int(l)] = stored
        res.notes += notes
    return res


# ---- the runner's entry point ----------------------------------------------------------------------

def load_or_random(job, layers, seed: int) -> tuple[dict[int, dict], dict[int, dict[str, Fp8Blocks]]]:
    """`weights=random` (seeded) or `weights=checkpoint` (`checkpoint.path=DIR`; both settings validated
    with the job, dsv4.values.settings.RunSettings): float32 weights per layer under our names, and per layer the
    linears stored as fp8 blocks -- a checkpoint's as stored; random ones made in that format when the
    job's `linear` multiplies in fp8 (the float values then their dequantization), else none."""
    if job.run.weights == "random":
        weights = {l: random_layer_weights(job.spec, l, seed) for l in layers}
        if job.combo.linear.numerics is not LinearNumerics.FP8:
            return weights, {}
        made = {l: in_fp8_blocks(w) for l, w in weights.items()}
        return {l: m[0] for l, m in made.items()}, {l: m[1] for l, m in made.items()}
    path = job.run.checkpoint.path
    model = job.choices.get("model", job.spec.name) if getattr(job, "choices", None) else job.spec.name
    loaded = load_layers(path, job.spec, layers, model_choice=model)
    print(loaded.summary(Path(str(path))))
    return loaded.weights, loaded.fp8
