"""The hub's FP8 checkpoints: config.json's quantization_config, F8_E4M3 safetensors without
torch, each projection's e4m3 weight and its scales, checked at load time.

Two layouts, read as transformers reads them:
  - compressed-tensors, format "float-quantized": `<name>.weight` e4m3 [N, K] and
    `<name>.weight_scale` per tensor ([] or [1]) or per output channel ([N, 1]);
    `<name>.input_scale` is read and unused (activations stay bf16);
  - fine-grained FP8 (quant_method "fp8", weight_block_size [bn, bk]): `<name>.weight` and
    `<name>.weight_scale_inv` [ceil(N / bn), ceil(K / bk)], which despite its name multiplies:
    w = q x s.
The safetensors package's numpy API (0.8) has no float8 dtype, so the files' header is parsed
here and the tensors memory-mapped as ml_dtypes arrays.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass
from typing import Optional

import ml_dtypes
import numpy as np

E4M3_MAX = 448.0
# 1 / 448 in float32. A channel's scale is max |w| times it, written as a product so numpy and
# XLA give the same bits (XLA turns a division by a constant into this multiplication).
INV_E4M3_MAX = np.float32(1.0 / E4M3_MAX)


def channel_scale(amax, xp=np):
    """max |w| of each output channel -> its float32 scale (1 for an all-zero channel); xp is
    numpy or jax.numpy, with the same bits from either."""
    a = xp.asarray(amax, np.float32)
    return xp.where(a > 0, a * INV_E4M3_MAX, np.float32(1.0)).astype(np.float32)


DTYPES = {"F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
          "BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype(np.float16),
          "F32": np.dtype(np.float32), "I32": np.dtype(np.int32), "I64": np.dtype(np.int64)}
NAMES = {v: k for k, v in DTYPES.items()}


class CheckpointError(ValueError):
    """A checkpoint's files are not what its config.json describes: a file that is not
    safetensors or is truncated, an index that is not JSON or maps a tensor to a file that
    lacks it, a tensor missing or of the wrong shape. The message names the file (relative to
    the checkpoint's directory) and the tensor at fault. (Defined here, the lowest of the
    weights modules that read files; checkpoint.py exports it.)"""


class Fp8CheckpointError(CheckpointError):
    """A checkpoint's FP8 tensors or quantization_config are not what the loader expects."""


# ---- safetensors with float8 -------------------------------------------------------------------

# bytes per element of each safetensors dtype (the format's own names)
ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2,
            "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def read_header(path: str) -> tuple[dict[str, dict], int]:
    """(name -> {"dtype", "shape", "data_offsets"}, the offset of the data) of one .safetensors
    file, without reading its tensors; checked, so that a file that is not safetensors or is
    truncated is a CheckpointError naming it (and the tensor past its end), not a reader's
    error mid-load: the header must be JSON of entries with a dtype, a shape and offsets that
    hold that many elements, and the data must end where the last tensor does."""
    fn = os.path.basename(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else None
        if n is None or n > size - 8:
            raise CheckpointError(f"{fn}: not a safetensors file (or truncated in its header): "
                                  f"its first 8 bytes give a header of {n} bytes, the file has "
                                  f"{size}")
        text = f.read(n)
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{fn}: not a safetensors file (its header is not JSON: "
                              f"{e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{fn}: not a safetensors file (its header is not a JSON object)")
    header.pop("__metadata__", None)
    data, end = size - 8 - n, 0
    for name, info in header.items():
        try:
            dtype, shape, (lo, hi) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            ok = (all(isinstance(d, int) and d >= 0 for d in shape) and isinstance(lo, int)
                  and isinstance(hi, int) and 0 <= lo <= hi)
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise CheckpointError(f"{fn}: not a safetensors file (tensor {name!r}: {info!r} is "
                                  f"not a dtype, a shape and data_offsets)")
        if dtype in ITEMSIZE and hi - lo != math.prod(shape) * ITEMSIZE[dtype]:
            raise CheckpointError(f"{fn}: tensor {name!r}: {dtype} {list(shape)} is "
                                  f"{math.prod(shape) * ITEMSIZE[dtype]} bytes, its "
                                  f"data_offsets give {hi - lo}")
        if hi > data:
            raise CheckpointError(f"{fn}: truncated: tensor {name!r} ends at byte {hi} of the "
                                  f"data, the file holds {data} bytes of data")
        end = max(end, hi)
    if end != data:
        raise CheckpointError(f"{fn}: not a safetensors file: {data - end} bytes after its last "
                              f"tensor")
    return header, 8 + n


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """Every tensor of one .safetensors file, memory-mapped (read-only numpy views)."""
    header, start = read_header(path)
    n = start - 8
    mm = np.memmap(path, np.uint8, "r")
    out = {}
    for name, info in header.items():
        if info["dtype"] not in DTYPES:
            raise Fp8CheckpointError(f"{path}: tensor {name!r} has dtype {info['dtype']}, "
                                     f"not one of {sorted(DTYPES)}")
        lo, hi = info["data_offsets"]
        out[name] = mm[8 + n + lo: 8 + n + hi].view(DTYPES[info["dtype"]]).reshape(info["shape"])
    return out


def write_safetensors(path: str, tensors: dict[str, np.ndarray],
                      metadata: Optional[dict] = None) -> None:
    """tensors (float8 included) as one .safetensors file, in name order."""
    header, blobs, off = {}, [], 0
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        if a.dtype not in NAMES:
            raise Fp8CheckpointError(f"{name}: cannot write dtype {a.dtype}")
        header[name] = {"dtype": NAMES[a.dtype], "shape": list(a.shape),
                        "data_offsets": [off, off + a.nbytes]}
        blobs.append(a.tobytes())
        off += a.nbytes
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for b in blobs:
            f.write(b)


# ---- quantization_config -----------------------------------------------------------------------

@dataclass(frozen=True)
class Fp8Scheme:
    """How a checkpoint stores its FP8 projections."""
    layout: str  # "compressed-tensors" or "fp8"
    strategy: str  # "tensor", "channel" or "block"
    block: tuple[int, int] = (0, 0)  # (bn, bk) for "block"
    ignore: tuple[str, ...] = ()  # modules left in bf16 (e.g. lm_head)

    @property
    def scale_suffix(self) -> str:
        return "weight_scale_inv" if self.layout == "fp8" else "weight_scale"

    @property
    def spec(self) -> str:
        """A short hashable name of the layout (a config field): 'compressed-tensors:channel',
        'fp8:128x128', 'fp8:tensor', ... (scheme_from_spec reads it back)."""
        if self.strategy == "block":
            return f"{self.layout}:{self.block[0]}x{self.block[1]}"
        return f"{self.layout}:{self.strategy}"

    def quantized(self, module: str) -> bool:
        """Whether `module` is not in ignore: a name (a suffix or prefix of it), or as
        compressed-tensors writes, "re:<pattern>" matched from its start."""
        return not any(re.match(i[3:], module) if i.startswith("re:") else
                       module == i or module.endswith("." + i) or module.startswith(i + ".")
                       for i in self.ignore)


def parse_quantization_config(config: dict) -> Optional[Fp8Scheme]:
    """The Fp8Scheme of a config.json (None: no quantization_config); raises Fp8CheckpointError
    naming what is unsupported."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise Fp8CheckpointError(f"quantization_config: fmt {fmt!r} (only e4m3 is read)")
        bs = qc.get("weight_block_size")
        if bs is None:
            return Fp8Scheme("fp8", "tensor", ignore=tuple(qc.get("modules_to_not_convert") or ()))
        if len(bs) != 2 or bs[1] % 16:
            raise Fp8CheckpointError(f"quantization_config: weight_block_size {bs} (expected "
                                     f"[bn, bk] with bk a multiple of 16, e.g. [128, 128])")
        return Fp8Scheme("fp8", "block", (int(bs[0]), int(bs[1])),
                         tuple(qc.get("modules_to_not_convert") or ()))
    if method == "compressed-tensors":
        if qc.get("format") != "float-quantized":
            raise Fp8CheckpointError(f"quantization_config: compressed-tensors format "
                                     f"{qc.get('format')!r} (only 'float-quantized' is read)")
        groups = list((qc.get("config_groups") or {}).values())
        if len(groups) != 1:
            raise Fp8CheckpointError(f"quantization_config: {len(groups)} config_groups "
                                     f"(one group of Linear weights is read)")
        wq = groups[0].get("weights") or {}
        if wq.get("type") != "float" or wq.get("num_bits") != 8:
            raise Fp8CheckpointError(f"quantization_config: weights {wq} (expected type 'float', "
                                     f"num_bits 8)")
        strategy = wq.get("strategy")
        if strategy not in ("tensor", "channel"):
            raise Fp8CheckpointError(f"quantization_config: weight strategy {strategy!r} "
                                     f"(expected 'tensor' or 'channel')")
        return Fp8Scheme("compressed-tensors", strategy, ignore=tuple(qc.get("ignore") or ()))
    raise Fp8CheckpointError(f"quantization_config: quant_method {method!r} (expected "
                             f"'compressed-tensors' or 'fp8')")


def scheme_from_spec(spec: str, ignore: tuple[str, ...] = ()) -> Fp8Scheme:
    """The Fp8Scheme named by Fp8Scheme.spec."""
    layout, _, strategy = spec.partition(":")
    if "x" in strategy:
        bn, bk = strategy.split("x")
        return Fp8Scheme(layout, "block", (int(bn), int(bk)), ignore)
    return Fp8Scheme(layout, strategy, ignore=ignore)


def quantization_config(scheme: Fp8Scheme) -> dict:
    """config.json's quantization_config for scheme (weights only: activations stay bf16, so
    compressed-tensors' input_activations is null and fine-grained FP8's scheme dynamic)."""
    if scheme.layout == "fp8":
        qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
              "modules_to_not_convert": list(scheme.ignore) or None}
        if scheme.strategy == "block":
            qc["weight_block_size"] = list(scheme.block)
        return qc
    weights = {"num_bits": 8, "type": "float", "strategy": scheme.strategy, "symmetric": True,
               "dynamic": False}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed", "ignore": list(scheme.ignore),
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": None}}}


# ---- one projection ----------------------------------------------------------------------------

def read_fp8_weight(tensors, module: str, scheme: Fp8Scheme):
    """(q e4m3 [N, K], scale float32 [SN, SK], block (bn, bk)) of `module` (e.g.
    "model.layers.0.self_attn.q_proj"), checked; `tensors` maps names to arrays."""
    wname, sname = f"{module}.weight", f"{module}.{scheme.scale_suffix}"
    if wname not in tensors:
        raise Fp8CheckpointError(f"{wname}: missing")
    q = tensors[wname]
    if q.dtype != DTYPES["F8_E4M3"]:
        raise Fp8CheckpointError(f"{wname}: dtype {NAMES.get(q.dtype, q.dtype)}, expected "
                                 f"F8_E4M3 (float8_e4m3fn)")
    if q.ndim != 2:
        raise Fp8CheckpointError(f"{wname}: shape {q.shape}, expected [out, in]")
    if sname not in tensors:
        raise Fp8CheckpointError(f"{sname}: missing (the scale of {wname})")
    n, k = q.shape
    s = np.asarray(tensors[sname]).astype(np.float32)
    if scheme.strategy == "block":
        bn, bk = scheme.block
        want = (math.ceil(n / bn), math.ceil(k / bk))
    elif scheme.strategy == "channel":
        bn, bk, want = 1, k, (n, 1)
    else:
        bn, bk, want = n, k, (1, 1)
        s = s.reshape(-1) if s.size == 1 else s
    if scheme.strategy == "channel" and s.shape == (n,):  # [N]: transformers reshapes it too
        s = s.reshape(want)
    if s.shape != want and not (want == (1, 1) and s.shape in ((1,), ())):
        raise Fp8CheckpointError(f"{sname}: shape {tuple(s.shape)}, expected {want} for "
                                 f"{wname} {tuple(q.shape)} ({scheme.strategy} scales)")
    s = s.reshape(want)
    if not np.isfinite(s).all() or (s == 0).any():
        raise Fp8CheckpointError(f"{sname}: non-finite or zero scales (expected finite, "
                                 f"non-zero)")
    if (s < 0).any():  # a sign flip folded into the scale is no checkpoint any writer makes
        raise Fp8CheckpointError(f"{sname}: negative scales (expected positive)")
    return q, s, (bn, bk)


def write_fp8_weight(out: dict, module: str, q, scale, scheme: Fp8Scheme) -> None:
    """The tensors read_fp8_weight reads, in scheme's layout (for save: the round trip)."""
    out[f"{module}.weight"] = np.asarray(q)
    s = np.asarray(scale, np.float32)
    out[f"{module}.{scheme.scale_suffix}"] = s.reshape(()) if scheme.strategy == "tensor" else s


def quantize_per_channel(w) -> tuple[np.ndarray, np.ndarray]:
    """A bf16/f32 [N, K] weight -> (q e4m3 [N, K], scale float32 [N, 1]): channel_scale of
    max |w| per output channel."""
    wf = np.asarray(w, np.float32)
    scale = channel_scale(np.abs(wf).max(axis=1, keepdims=True))
    q = np.clip(wf / scale, -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn)
    return q, scale


def read_checkpoint_dir(path: str) -> dict[str, np.ndarray]:
    """Every tensor of every .safetensors file of a checkpoint folder (memory-mapped)."""
    out = {}
    for fn in sorted(os.listdir(path)):
        if fn.endswith(".safetensors"):
            out.update(read_safetensors(os.path.join(path, fn)))
    return out
