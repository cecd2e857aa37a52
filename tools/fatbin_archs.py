"""Lists the GPU code a shared object (or a wheel's) carries: per architecture,
SASS or PTX, and how many kernels each holds.

    python tools/fatbin_archs.py build/*/_sifar*.so      # what `pip install -e .` built
    python tools/fatbin_archs.py dist/sifar_jax-*.whl

Reads the fatbins nvcc embeds (magic 0xBA55ED50; entry kind 1 = PTX, 2 = ELF
SASS) without cuobjdump, which a CUDA installation may lack. PTX that nvcc
compressed (zstd) is read through the `zstd` command when it exists; kernels
are counted by name (`.entry` in PTX, `.text.<kernel>` sections in SASS), so
"every kernel built for every architecture" is one comparison of the sets.
"""

from __future__ import annotations

import collections
import re
import shutil
import struct
import subprocess
import sys
import zipfile

MAGIC = struct.pack("<I", 0xBA55ED50)
ZSTD = b"(\xb5/\xfd"


def _ptx_text(payload: bytes) -> bytes | None:
    at = payload.find(ZSTD)
    if at < 0:
        return payload
    if shutil.which("zstd") is None:
        return None
    return subprocess.run(["zstd", "-dcq"], input=payload[at:], capture_output=True).stdout


def kernels(data: bytes) -> dict[tuple[str, int], set[str] | None]:
    """{("SASS" | "PTX", sm number): kernel names (None: compressed, unreadable)}."""
    out: dict = collections.defaultdict(set)
    i = 0
    while (i := data.find(MAGIC, i)) >= 0:
        _, header, size = struct.unpack_from("<HHQ", data, i + 4)
        j, end = i + header, i + header + size
        while j < end:
            kind, _, entry_header, padded = struct.unpack_from("<HHII", data, j)
            sm = struct.unpack_from("<I", data, j + 28)[0]
            payload = data[j + entry_header:j + entry_header + padded]
            if kind == 1:
                text = _ptx_text(payload)
                names = None if text is None else set(re.findall(rb"\.entry\s+([\w$]+)", text))
                key = ("PTX", sm)
            else:
                names = set(re.findall(rb"\.text\.([\w$]+)", payload))
                key = ("SASS", sm)
            if names is None or out.get(key, set()) is None:
                out[key] = None
            else:
                out[key] |= names
            j += entry_header + padded
        i = end
    return dict(out)


def _objects(path: str):
    if path.endswith(".whl"):
        with zipfile.ZipFile(path) as z:
            for name in z.namelist():
                if ".so" in name.rsplit("/", 1)[-1]:
                    yield name, z.read(name)
    else:
        with open(path, "rb") as f:
            yield path, f.read()


def main(paths: list[str]) -> int:
    ok = True
    for path in paths:
        for name, data in _objects(path):
            found = kernels(data)
            print(f"{name}:")
            if not found:
                print("  no GPU code (a build without the CUDA backend)")
                continue
            sets = [v for v in found.values() if v is not None]
            for (kind, sm), names in sorted(found.items(), key=lambda kv: (kv[0][1], kv[0][0])):
                count = "? kernels (compressed; no zstd here)" if names is None else \
                    f"{len(names)} kernels"
                print(f"  {kind:<4} {'sm' if kind == 'SASS' else 'compute'}_{sm}: {count}")
            same = all(s == sets[0] for s in sets)
            ok &= same
            print(f"  every architecture holds the same kernels: {'yes' if same else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
