"""Machine limits and run conditions: the roofline probes (``libdsv4_roofline``) and a description of the machine.

The probes come from a small native library built next to the custom-op library (``bench/roofline.cc``):

* :func:`read_bandwidth` - sustained DRAM read bandwidth, every thread streaming its own slice of one buffer well
  beyond the last-level cache;
* :func:`peak_compute` - arithmetic throughput of each instruction path the kernels use (fp32 mul+add at the x86-64
  baseline, fp32 FMA on ymm / zmm, AVX512-BF16 dot products, AMX-BF16) and the int8 paths onnxruntime's quantised
  MatMul may take, from register-resident loops.

When the library is missing (a build without it, a non-x86 machine) the bandwidth falls back to a numpy streaming
sum (one thread; labelled as such) and the compute peaks are reported as unavailable.

Roofs use the *best* repetition: other processes can only slow a probe down, never speed it up, so on a shared
machine the best sample is the closest to what the hardware sustains. Every sample is kept in the results.
"""

from __future__ import annotations

import ctypes
import os
import platform
import re
import sys
import time
from pathlib import Path

import numpy as np

ROOFLINE_LIBRARY = "libdsv4_roofline.so"
ABI_VERSION = 1

# Peak kinds of the library, in its order (dsv4rl_kind_name), with a description for the report.
PEAK_PATHS = {
    "fp32_sse_muladd": "fp32 mulps+addps on xmm (x86-64 baseline, what the scalar kernels may use)",
    "fp32_fma_ymm": "fp32 FMA on ymm (AVX2)",
    "fp32_fma_zmm": "fp32 FMA on zmm (AVX-512F)",
    "bf16_dp_zmm": "AVX512-BF16 vdpbf16ps on zmm (bf16 products, fp32 sums)",
    "amx_bf16": "AMX-BF16 tdpbf16ps (16x16 fp32 tiles)",
    "int8_vnni_zmm": "AVX512-VNNI vpdpbusd (int8 products, int32 sums; onnxruntime's int8 paths only)",
    "amx_int8": "AMX-INT8 tdpbusd (onnxruntime's int8 paths only)",
}

# Compute paths a kernel may use at each ISA level. The compute roof of a kernel is the best of these at its
# effective level, whatever its activation type: a roof is an upper bound, and a kernel may round float32
# activations to bf16 internally to use the bf16 paths (the record names the path that set the roof).
_SCALAR = ["fp32_sse_muladd"]
_AVX2 = _SCALAR + ["fp32_fma_ymm"]
_AVX512 = _AVX2 + ["fp32_fma_zmm", "bf16_dp_zmm"]
_AMX = _AVX512 + ["amx_bf16"]
LEVEL_PATHS = {level: {"float32": paths, "bfloat16": paths}
               for level, paths in (("scalar", _SCALAR), ("avx2", _AVX2), ("avx512", _AVX512), ("amx", _AMX))}


# ---------------------------------------------------------------------------------------------------- library


def roofline_library_path() -> str | None:
    """Where libdsv4_roofline.so is: ``DSV4_ORT_ROOFLINE_LIBRARY``, else next to the custom-op library."""
    override = os.environ.get("DSV4_ORT_ROOFLINE_LIBRARY")
    if override:
        if not Path(override).is_file():
            raise FileNotFoundError(f"DSV4_ORT_ROOFLINE_LIBRARY={override!r} does not exist")
        return str(Path(override).resolve())
    candidates = []
    try:
        import dsv4_ort

        candidates.append(Path(dsv4_ort.get_library_path()).parent / ROOFLINE_LIBRARY)
    except Exception:
        pass
    candidates.append(Path(__file__).resolve().parent.parent / "lib" / ROOFLINE_LIBRARY)
    for c in candidates:
        if c.is_file():
            return str(c)
    return None


_LIB = None


def _library():
    global _LIB
    if _LIB is None:
        path = roofline_library_path()
        if path is None:
            _LIB = False
            return None
        lib = ctypes.CDLL(path)
        lib.dsv4rl_abi_version.restype = ctypes.c_int
        if lib.dsv4rl_abi_version() != ABI_VERSION:
            raise RuntimeError(f"{path} has ABI version {lib.dsv4rl_abi_version()}, expected {ABI_VERSION}; "
                               "rebuild the package")
        lib.dsv4rl_features.restype = ctypes.c_uint32
        lib.dsv4rl_num_kinds.restype = ctypes.c_int
        lib.dsv4rl_kind_name.restype = ctypes.c_char_p
        lib.dsv4rl_kind_name.argtypes = [ctypes.c_int]
        lib.dsv4rl_kind_supported.argtypes = [ctypes.c_int]
        lib.dsv4rl_read_bandwidth.argtypes = [ctypes.c_uint64, ctypes.c_int, ctypes.c_int,
                                              ctypes.POINTER(ctypes.c_double), ctypes.POINTER(ctypes.c_int)]
        lib.dsv4rl_peak.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_double, ctypes.c_int,
                                    ctypes.POINTER(ctypes.c_double)]
        lib.path = path
        _LIB = lib
    return _LIB or None


def _stats(samples) -> dict:
    a = np.asarray(samples, dtype=np.float64)
    return {"samples": [round(float(x), 3) for x in a], "best": float(a.max()), "median": float(np.median(a)),
            "min": float(a.min())}


def read_bandwidth(nbytes: int, threads: int, reps: int) -> dict:
    """Sustained read bandwidth in GB/s (1e9 B/s) over a ``nbytes`` buffer on ``threads`` threads."""
    lib = _library()
    if lib is not None:
        out = (ctypes.c_double * reps)()
        width = ctypes.c_int(0)
        t0 = time.perf_counter()
        rc = lib.dsv4rl_read_bandwidth(int(nbytes), int(threads), int(reps), out, ctypes.byref(width))
        if rc != 0:
            raise RuntimeError(f"dsv4rl_read_bandwidth failed ({rc}) for {nbytes} bytes")
        return {"method": f"native stream read, {width.value}-bit loads", "bytes": int(nbytes), "threads": threads,
                "seconds": round(time.perf_counter() - t0, 3), **_stats(out[:reps])}
    # Fallback: numpy sum of a float32 array (one thread; vectorised by numpy).
    a = np.ones(int(nbytes) // 4, np.float32)
    a.sum()
    gbs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a.sum()
        gbs.append(a.nbytes / (time.perf_counter() - t0) / 1e9)
    return {"method": "numpy sum fallback (libdsv4_roofline not found; one thread)", "bytes": int(nbytes),
            "threads": 1, **_stats(gbs)}


def peak_compute(threads: int, seconds: float, reps: int) -> dict:
    """Peak GFLOP/s (GOP/s for int8) of every instruction path this CPU supports, on ``threads`` threads."""
    lib = _library()
    out = {}
    if lib is None:
        return out
    for kind in range(lib.dsv4rl_num_kinds()):
        name = lib.dsv4rl_kind_name(kind).decode()
        if not lib.dsv4rl_kind_supported(kind):
            continue
        buf = (ctypes.c_double * reps)()
        rc = lib.dsv4rl_peak(kind, int(threads), float(seconds), int(reps), buf)
        if rc != 0:
            continue
        out[name] = {"threads": threads, "description": PEAK_PATHS.get(name, name), **_stats(buf[:reps])}
    return out


def compute_roof(peaks: dict, level: str, act_dtype: str) -> tuple[str | None, float | None]:
    """(path, GFLOP/s) of the best compute path available to a kernel at ``level`` with ``act_dtype`` activations."""
    best = (None, None)
    for path in LEVEL_PATHS.get(level, LEVEL_PATHS["scalar"]).get(act_dtype, []):
        if path in peaks and (best[1] is None or peaks[path]["best"] > best[1]):
            best = (path, peaks[path]["best"])
    return best


# ---------------------------------------------------------------------------------------------------- machine


def _cpuinfo() -> dict:
    info = {"model": platform.processor() or "unknown", "flags": []}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    m = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    if m:
        info["model"] = m.group(1).strip()
    m = re.search(r"^flags\s*:\s*(.+)$", text, re.M)
    if m:
        keep = ("avx", "fma", "f16c", "amx", "vnni", "bf16", "fp16")
        info["flags"] = sorted(f for f in m.group(1).split() if any(k in f for k in keep))
    m = re.search(r"^flags\s*:.*\bhypervisor\b", text, re.M)
    info["virtualised"] = bool(m)
    return info


def cache_sizes() -> dict:
    """Cache sizes in bytes from sysfs (cpu0), keyed L1d/L1i/L2/L3."""
    out = {}
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    for idx in sorted(base.glob("index*")) if base.is_dir() else []:
        try:
            level = (idx / "level").read_text().strip()
            kind = (idx / "type").read_text().strip()
            size = (idx / "size").read_text().strip()
        except OSError:
            continue
        mult = {"K": 1024, "M": 1024 ** 2, "G": 1024 ** 3}.get(size[-1], 1)
        value = int(size[:-1]) * mult if size[-1] in "KMG" else int(size)
        key = f"L{level}" + ({"Data": "d", "Instruction": "i"}.get(kind, ""))
        out[key] = value
    if not out:
        try:
            out["L3"] = int(os.sysconf("SC_LEVEL3_CACHE_SIZE"))
        except (ValueError, OSError):
            pass
    return out


def llc_bytes() -> int:
    c = cache_sizes()
    return max([v for k, v in c.items() if k in ("L2", "L3")] or [32 << 20])


def memory() -> dict:
    out = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            k, v = line.split(":", 1)
            if k in ("MemTotal", "MemAvailable"):
                out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def _version(mod: str) -> str | None:
    try:
        from importlib import metadata

        return metadata.version(mod)
    except Exception:
        return None


def describe(threads: int) -> dict:
    """CPU, caches, memory, thread count, software versions and the library's view of the CPU."""
    import dsv4_ort

    cpu = _cpuinfo()
    lib = _library()
    info = {}
    try:
        info = dsv4_ort.library_info()
    except Exception as e:  # the suite still reports the machine
        info = {"error": str(e)}
    try:
        from dsv4_ort.runtime.session import physical_cores

        cores = physical_cores()
    except Exception:
        cores = os.cpu_count() or 1
    return {
        "cpu": {"model": cpu["model"], "flags": cpu["flags"], "virtualised": cpu.get("virtualised", False),
                "logical_cpus": os.cpu_count(), "physical_cores": cores,
                "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None},
        "caches": cache_sizes(),
        "memory": memory(),
        "threads": threads,
        "os": f"{platform.system()} {platform.release()}",
        "python": sys.version.split()[0],
        "versions": {"dsv4-ort": dsv4_ort.__version__, "onnxruntime": _version("onnxruntime"),
                     "numpy": _version("numpy"), "torch": _version("torch"), "transformers": _version("transformers"),
                     "onnx": _version("onnx")},
        "library": {"path": info.get("library_path"), "isa_max": info.get("isa_max"),
                    "features": info.get("features"), "op_table_version": info.get("op_table_version")},
        "roofline_library": getattr(lib, "path", None) if lib else None,
        "roofline_features": int(lib.dsv4rl_features()) if lib else None,
    }


# ---------------------------------------------------------------------------------------------------- load


class LoadMeter:
    """CPU time used by *other* processes while a measurement ran: (busy time of all CPUs - this process's CPU
    time) / (wall time x CPUs), from /proc/stat and os.times(). 0 = the machine was ours; 0.5 on two CPUs = one
    CPU's worth of other work ran meanwhile. Also the load average at the end and the steal time (VMs)."""

    def __init__(self):
        self.hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.ncpu = os.cpu_count() or 1
        self.start()

    @staticmethod
    def _proc_stat():
        try:
            with open("/proc/stat") as f:
                parts = f.readline().split()[1:]
            v = [int(x) for x in parts]
        except (OSError, ValueError):
            return None
        idle = v[3] + (v[4] if len(v) > 4 else 0)
        steal = v[7] if len(v) > 7 else 0
        return sum(v[:8]) - idle - steal, steal

    def start(self):
        self.t0 = time.perf_counter()
        self.s0 = self._proc_stat()
        t = os.times()
        self.c0 = t.user + t.system
        return self

    def stop(self) -> dict:
        wall = time.perf_counter() - self.t0
        s1 = self._proc_stat()
        t = os.times()
        mine = t.user + t.system - self.c0
        out = {"wall_s": round(wall, 4)}
        if self.s0 is not None and s1 is not None and wall > 0:
            busy = (s1[0] - self.s0[0]) / self.hz
            steal = (s1[1] - self.s0[1]) / self.hz
            out["other_cpu"] = round(max(0.0, busy - mine) / (wall * self.ncpu), 3)
            out["steal"] = round(steal / (wall * self.ncpu), 3)
        try:
            out["loadavg"] = round(os.getloadavg()[0], 2)
        except OSError:
            pass
        return out


def measure_limits(threads: int, *, bw_bytes: int, bw_reps: int, peak_seconds: float, peak_reps: int,
                   log=print) -> dict:
    """Bandwidth on 1 and ``threads`` threads, compute peaks on 1 and ``threads`` threads."""
    out = {"bandwidth": {}, "peaks": {}, "peaks_1thread": {}}
    meter = LoadMeter()
    bw = read_bandwidth(bw_bytes, threads, bw_reps)
    out["bandwidth"]["all_threads"] = bw
    if threads > 1:
        out["bandwidth"]["one_thread"] = read_bandwidth(bw_bytes, 1, max(2, bw_reps // 2))
    log(f"  read bandwidth: {bw['best']:.1f} GB/s best, {bw['median']:.1f} median ({threads} threads, "
        f"{bw_bytes / 2**20:.0f} MiB, {bw['method']})")
    out["peaks"] = peak_compute(threads, peak_seconds, peak_reps)
    if threads > 1:
        out["peaks_1thread"] = peak_compute(1, peak_seconds, max(2, peak_reps - 1))
    for name, p in out["peaks"].items():
        log(f"  peak {name:<16} {p['best']:9.1f} GFLOP/s ({threads} threads)")
    out["conditions"] = meter.stop()
    return out


__all__ = ["read_bandwidth", "peak_compute", "compute_roof", "describe", "cache_sizes", "llc_bytes", "memory",
           "LoadMeter", "measure_limits", "roofline_library_path", "PEAK_PATHS", "LEVEL_PATHS"]
