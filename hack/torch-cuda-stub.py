#!/usr/bin/env python3
"""Make PyPI's CUDA torch a CPU torch: replace libtorch_cuda.so with a stub, so no CUDA library is needed.

Why: PyPI's only Linux x86_64 torch is the CUDA build. Its libtorch.so and libtorch_python.so link
libtorch_cuda.so (1 GB), which links cuBLAS, cuDNN, NCCL, cuSPARSE(Lt), cuFFT, cuRAND, cuFile and NVSHMEM
(~4 GB of nvidia-* wheels); libtorch_python.so links cuDNN, cuSPARSELt and cuFile itself. So even
`import torch` on a CPU needs all of them. The engine's CPU image (kind, CPU nodes; Dockerfile VARIANT=cpu)
never runs a CUDA kernel. This script, run in the image's build stage on the installed venv:

  1. plans: the removed libraries are torch's CUDA libraries and every nvidia-* wheel's but the CUDA
     runtime and CUPTI (KEEP_*); the symbols to stub are those the kept libraries import, no kept or
     system library defines, and a removed one does (~125 today: the torch.cuda bindings' entry points,
     one cuDNN function, a few typeinfos and vtables);
  2. writes and compiles a stand-in for each removed library a kept one links (same SONAME, versioned
     symbols under their version node): functions print their name and abort, typeinfos are real, other
     objects are zeroed, AT_IMPORT functions are defined as torch's source does; puts them in torch/lib
     (the kept libraries look in $ORIGIN first) and deletes the real ones;
  3. uninstalls the removed nvidia-* wheels with the venv's pip (--pip), so pip's records stay true.

What it means at run time: libtorch_cuda.so's static initialisers never run, so torch has no CUDA hooks or
kernels registered: `torch.cuda.is_available()` is False, exactly as in a CPU build, and a CUDA tensor
raises torch's own "Cannot initialize CUDA without ATen_cuda library". A stub is reached only by calling
into torch.cuda's internals directly; it names itself on stderr and aborts, never returns garbage.
`--check` imports torch in a fresh interpreter, multiplies on the CPU and tries a CUDA tensor.
docs/adr/0017-cpu-image-stubs-libtorch-cuda.md says why this and not the alternatives.

Usage: torch-cuda-stub.py SITE_PACKAGES [--pip 'PIP --python PY'] [--cc gcc] [--check [--python PY]]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

STUBBED = "libtorch_cuda.so"  # gets every symbol the kept libraries take from a removed one
TORCH_CUDA_LIBS = ("libtorch_cuda.so", "libtorch_nvshmem.so", "libtorch_cuda_linalg.so", "libcaffe2_nvrtc.so")
# kept nvidia-* wheels: the CUDA runtime (libc10_cuda.so and libtorch_global_deps.so link it; without a
# driver it answers "no device") and CUPTI (libtorch_cpu.so links it for the profiler); 46 MB together
KEEP_DIRS = {"cuda_runtime", "cuda_cupti"}
KEEP_DISTS = {"nvidia-cuda-runtime-cu12", "nvidia-cuda-cupti-cu12"}
# functions libtorch_python.so calls while torch is imported, defined the way their source does (no abort)
AT_IMPORT = {
    # c10d::gil_checker_t& c10d::get_gil_checker(): a reference to a settable static function pointer
    "_ZN4c10d15get_gil_checkerEv": "static void *gil_checker; return &gil_checker;",
}


def nm(lib: Path, *flags: str) -> list[list[str]]:
    out = subprocess.run(["nm", "-D", *flags, str(lib)], check=True, capture_output=True, text=True).stdout
    return [line.split() for line in out.splitlines() if line.strip()]


def unversioned(symbol: str) -> str:
    return symbol.split("@", 1)[0]


def needed(lib: Path) -> list[str]:
    out = subprocess.run(["readelf", "-d", str(lib)], check=True, capture_output=True, text=True).stdout
    return [line.split("[", 1)[1].rstrip("]") for line in out.splitlines() if "(NEEDED)" in line]


def resolved(lib: Path) -> list[Path]:
    """The libraries the loader finds for `lib` now (before anything is removed)."""
    out = subprocess.run(["ldd", str(lib)], check=True, capture_output=True, text=True).stdout
    return [Path(line.split("=>")[1].split("(")[0].strip()) for line in out.splitlines()
            if "=>" in line and "not found" not in line and "/" in line]


@dataclass
class Stub:
    """One stand-in library: its SONAME and the symbols it defines (a version node when the users ask for one)."""

    soname: str
    funcs: list[str] = field(default_factory=list)
    objects: list[tuple[str, int]] = field(default_factory=list)
    versions: dict[str, str] = field(default_factory=dict)  # symbol -> version node


@dataclass
class Plan:
    """What replaces what: the removed libraries, the kept libraries that link them, the stubs to write."""

    removed: list[Path]
    users: list[Path]
    stubs: dict[str, Stub]


def plan(site: Path) -> Plan:
    lib_dir = site / "torch" / "lib"
    nvidia = site / "nvidia"
    removed = [lib_dir / n for n in TORCH_CUDA_LIBS if (lib_dir / n).exists()]
    if nvidia.is_dir():
        removed += [f for d in sorted(nvidia.iterdir()) if d.is_dir() and d.name not in KEEP_DIRS
                    for f in sorted(d.rglob("*.so*")) if f.is_file()]
    gone = {f.name for f in removed}
    users = [f for f in sorted((site / "torch").rglob("*.so*")) if f.is_file() and f.name not in gone]
    stubs = {n: Stub(n) for n in sorted({n for u in users for n in needed(u) if n in gone})}
    if STUBBED not in stubs:
        raise SystemExit(f"torch-cuda-stub: nothing links {STUBBED}: is this PyPI's CUDA torch?")
    kept_paths = {p.resolve() for u in users for p in resolved(u) if p.name not in gone} | {u.resolve() for u in users}
    provided = {unversioned(r[-1]) for p in kept_paths for r in nm(p, "--defined-only")}
    imported: dict[str, str] = {}
    for u in users:
        for r in nm(u, "--undefined-only"):
            imported.setdefault(unversioned(r[-1]), r[-1])
    orphans = {name: full for name, full in imported.items() if name not in provided}
    seen: set[str] = set()
    for lib in removed:
        for row in nm(lib, "--defined-only", "-S"):
            name = unversioned(row[-1])
            if len(row) != 4 or name not in orphans or name in seen:
                continue
            seen.add(name)
            # a versioned reference (cudnnGetProperty@libcudnn.so.9) binds to that library's version node:
            # its own stub defines it; the rest go to libtorch_cuda.so's stub, loaded before any user looks
            version = orphans[name].split("@", 1)[1] if "@" in orphans[name] else ""
            home = stubs.get(lib.name) if version else stubs[STUBBED]
            if home is None:
                raise SystemExit(f"torch-cuda-stub: {orphans[name]} comes from {lib.name}, which nothing links")
            if version:
                home.versions[name] = version
            size, kind = int(row[1], 16), row[2]
            if kind in "TtWwi":
                home.funcs.append(name)
            elif kind in "VvDdBbRr":
                home.objects.append((name, size))
            else:
                raise SystemExit(f"torch-cuda-stub: {name} has symbol type {kind!r}, which this script cannot stub")
    return Plan(removed, users, stubs)


def version_script(st: Stub) -> str:
    nodes: dict[str, list[str]] = {}
    for name, version in sorted(st.versions.items()):
        nodes.setdefault(version, []).append(name)
    return "".join(f"{v} {{ global: {'; '.join(names)}; }};\n" for v, names in nodes.items())


def c_source(soname: str, funcs: list[str], objects: list[tuple[str, int]]) -> str:
    lines = [
        f"/* generated by hack/torch-cuda-stub.py: the CPU image's stand-in for {soname} */",
        "#include <stdio.h>",
        "#include <stdlib.h>",
        "static void kascade_cuda_stub(const char *name) {",
        '  fprintf(stderr, "kascade CPU image: %s is in a CUDA library this image does not ship "',
        '          "(use the CUDA image for GPUs)\\n", name);',
        "  abort();",
        "}",
    ]
    for i, name in enumerate(funcs):
        if name in AT_IMPORT:
            lines.append(f'void *kascade_stub_{i}(void) __asm__("{name}");')
            lines.append(f"void *kascade_stub_{i}(void) {{ {AT_IMPORT[name]} }}")
        else:
            lines.append(f'void kascade_stub_{i}(void) __asm__("{name}");')
            lines.append(f'void kascade_stub_{i}(void) {{ kascade_cuda_stub("{name}"); }}')
    # a typeinfo must be one (pybind11 hashes every bound class's typeid().name() while torch._C is
    # imported): an __class_type_info (its vtable from libstdc++, then the mangled name), with the
    # original's size (a derived class's base pointer, if any, stays null: nothing walks it without an
    # object of that class, and none can be made). Other objects (vtables) are only read through an object.
    lines.append("extern const char _ZTVN10__cxxabiv117__class_type_infoE[];")
    for i, (name, size) in enumerate(objects):
        if name.startswith("_ZTI") and size >= 16:
            lines.append(
                f'const void *kascade_obj_{i}[{size // 8}] __asm__("{name}") = '
                f'{{_ZTVN10__cxxabiv117__class_type_infoE + 16, "{name[4:]}"}};'
            )
        else:
            lines.append(f'__attribute__((aligned(16))) char kascade_obj_{i}[{max(size, 1)}] __asm__("{name}");')
    return "\n".join(lines) + "\n"


def stub(site: Path, cc: str, pip: list[str] | None) -> None:
    lib_dir = site / "torch" / "lib"
    if (lib_dir / STUBBED).stat().st_size < 1 << 20:
        print(f"torch-cuda-stub: {lib_dir / STUBBED} is already a stub", file=sys.stderr)
        return
    p = plan(site)
    freed = sum(f.stat().st_size for f in p.removed)
    with tempfile.TemporaryDirectory() as tmp:
        built: list[Path] = []
        for st in p.stubs.values():
            src = Path(tmp) / f"{st.soname}.c"
            src.write_text(c_source(st.soname, sorted(st.funcs), sorted(st.objects)))
            out = Path(tmp) / st.soname
            cmd = [cc, "-shared", "-fPIC", "-O1", "-s", f"-Wl,-soname,{st.soname}", "-o", str(out), str(src)]
            if st.versions:
                (Path(tmp) / f"{st.soname}.map").write_text(version_script(st))
                cmd.append(f"-Wl,--version-script={Path(tmp) / f'{st.soname}.map'}")
            subprocess.run(cmd, check=True)
            built.append(out)
        for lib in p.removed:
            if lib.parent == lib_dir:
                lib.unlink()
        for out in built:
            shutil.move(str(out), lib_dir / out.name)  # torch's libraries find $ORIGIN first
    nvidia = site / "nvidia"
    if pip:  # the nvidia-* distributions but the kept ones, so pip's records stay true
        listed = subprocess.run([*pip, "list", "--format=freeze"], check=True, capture_output=True, text=True).stdout
        dists = [ln.split("==")[0] for ln in listed.splitlines() if ln.startswith("nvidia-")]
        drop = [d for d in dists if d not in KEEP_DISTS]
        if drop:
            subprocess.run([*pip, "uninstall", "-y", "-q", *drop], check=True)
    for d in sorted(nvidia.iterdir()) if nvidia.is_dir() else []:
        if d.is_dir() and d.name not in KEEP_DIRS and d.name != "__pycache__":
            shutil.rmtree(d)
    made = ", ".join(f"{st.soname} ({len(st.funcs)} functions, {len(st.objects)} objects)" for st in p.stubs.values())
    print(f"torch-cuda-stub: stubs {made}; {len(p.removed)} CUDA libraries ({freed / 1e9:.2f} GB) removed",
          file=sys.stderr)


CHECK = """
import torch
assert not torch.cuda.is_available(), "a CPU image reports CUDA"
a = torch.randn(64, 64)
assert torch.allclose(a @ torch.eye(64), a)
try:
    torch.zeros(1, device="cuda")
except (RuntimeError, AssertionError) as e:
    print("torch-cuda-stub: a CUDA tensor raises:", str(e).splitlines()[0])
else:
    raise SystemExit("a CUDA tensor was made in a CPU image")
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("site", type=Path, help="the venv's site-packages holding torch/ and nvidia/")
    ap.add_argument("--cc", default="gcc")
    ap.add_argument("--check", action="store_true", help="then import torch in a fresh interpreter and use it")
    ap.add_argument("--python", default=sys.executable, help="the interpreter for --check")
    ap.add_argument("--pip", help="a pip command for the venv (uninstalls the nvidia-* wheels); else rm -r")
    args = ap.parse_args()
    if not (args.site / "torch" / "lib" / STUBBED).exists():
        raise SystemExit(f"torch-cuda-stub: no torch/lib/{STUBBED} under {args.site}")
    stub(args.site, args.cc, args.pip.split() if args.pip else None)
    if args.check:
        subprocess.run([args.python, "-c", CHECK], check=True)


if __name__ == "__main__":
    main()
