"""The library never executes an instruction the CPU lacks: code outside the ISA files (*_avx2.cc, *_avx512.cc,
*_amx.cc, which run only after the load-time CPU probe chose them) is plain x86-64. The object files of the build
that produced the library in use are disassembled; outside the ISA files no ymm / zmm / tmm register, AVX-512 mask
register, VEX / EVEX-encoded instruction (AVX, even on xmm), AMX, BMI, LZCNT or POPCNT instruction may appear. SSE
and SSE2 on xmm registers are part of the x86-64 baseline and allowed."""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ISA_FILE = re.compile(r"_(avx2|avx512|amx)\.cc\.o$")
FORBIDDEN = re.compile(
    r"%[yzt]mm\d+"                                    # 256/512-bit vector and AMX tile registers
    r"|%k[0-7]\b"                                     # AVX-512 mask registers
    r"|^\s*v(?!err|erw)[a-z0-9]+\b"                   # VEX / EVEX encodings (every AVX instruction, xmm or not)
    r"|^\s*(ldtilecfg|sttilecfg|tileloadd\w*|tilestored|tilezero|tilerelease|tdp\w+)\b"  # AMX
    r"|^\s*(andn|bextr|blsi|blsmsk|blsr|bzhi|pdep|pext|sarx|shlx|shrx|rorx|mulx|lzcnt|popcnt)\b")  # BMI1/2, ABM
# The CPU probe itself reads XCR0 (xgetbv), after cpuid has reported OSXSAVE.
ALLOWED = {"cpu_features.cc.o": re.compile(r"^\s*xgetbv\b")}


def _identity(path: Path) -> str:
    """The linker's GNU build-id (unchanged by an install that rewrites RPATH), else the file's hash."""
    notes = subprocess.run(["readelf", "-n", str(path)], capture_output=True, text=True).stdout
    m = re.search(r"Build ID:\s*([0-9a-f]+)", notes)
    return m.group(1) if m else hashlib.sha256(path.read_bytes()).hexdigest()


def _build_tree() -> Path:
    """The build directory whose libdsv4_ort.so is the library the tests load (a fresh build when none is)."""
    import dsv4_ort

    lib = Path(dsv4_ort.get_library_path()).resolve()
    digest = _identity(lib)
    candidates = [lib.parent.parent] + sorted((REPO / "build").glob("*"))
    for root in candidates:
        so = root / "custom_ops" / "libdsv4_ort.so"
        if (root / "custom_ops" / "CMakeFiles").is_dir() and so.is_file() and _identity(so) == digest:
            return root
    return _fresh_build()


def _fresh_build() -> Path:
    """Builds the library's objects (Release, as the package) into build/isa-objects."""
    root = REPO / "build" / "isa-objects"
    args = ["cmake", "-S", str(REPO), "-B", str(root), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
            "-DDSV4_BUILD_ROOFLINE=OFF"]
    debs = sorted(REPO.glob("build/*/_deps/ort-headers/libonnxruntime-dev_*.deb"))
    if debs and not (root / "CMakeCache.txt").exists():
        args.append(f"-DDSV4_ORT_HEADERS_DEB={debs[0]}")
    subprocess.run(args, check=True, capture_output=True, text=True)
    subprocess.run(["cmake", "--build", str(root), "--target", "dsv4_ort"], check=True, capture_output=True,
                   text=True, timeout=3600)
    return root


@pytest.fixture(scope="module")
def objects():
    if shutil.which("objdump") is None:
        pytest.skip("objdump (binutils) is not installed")
    root = _build_tree()
    objs = sorted((root / "custom_ops" / "CMakeFiles").rglob("*.o"))
    assert objs, f"no object files under {root}"
    return objs


def _disassembly(obj: Path) -> list:
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(obj)], check=True, capture_output=True,
                         text=True).stdout
    # Instruction lines are "  addr:\tmnemonic operands"; keep "mnemonic operands".
    return [line.split("\t", 1)[1] for line in out.splitlines() if re.match(r"^\s+[0-9a-f]+:\t", line)
            and "\t" in line]


def test_baseline_objects_use_no_isa_extension(objects):
    baseline = [o for o in objects if not ISA_FILE.search(o.name)]
    assert any(o.name == "cpu_features.cc.o" for o in baseline) and any("_op.cc.o" in o.name for o in baseline)
    bad = {}
    for obj in baseline:
        allowed = ALLOWED.get(obj.name)
        hits = [ins for ins in _disassembly(obj) if FORBIDDEN.search(ins) and not (allowed and allowed.search(ins))]
        if hits:
            bad[str(obj.relative_to(obj.parents[3]))] = sorted(set(hits))[:5]
    assert not bad, "ISA instructions outside the ISA files (move the code into a *_avx2/_avx512/_amx.cc file):\n" + \
        "\n".join(f"{k}: {v}" for k, v in bad.items())


def test_isa_objects_are_recognised(objects):
    """The check sees what it looks for: the AVX2 files use ymm registers, the AVX-512 files zmm registers."""
    def uses(suffix, pattern):
        return any(re.search(pattern, ins) for o in objects if o.name.endswith(suffix) for ins in _disassembly(o))

    assert uses("_avx2.cc.o", r"%ymm\d+")
    assert uses("_avx512.cc.o", r"%zmm\d+")
    if any(o.name.endswith("_amx.cc.o") for o in objects):
        assert uses("_amx.cc.o", r"%tmm\d+|\btdp\w+")
