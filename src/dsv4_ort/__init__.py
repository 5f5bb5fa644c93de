"""dsv4-ort: DeepSeek-V4 inference on CPUs through stock ONNX Runtime.

Subpackages: ``dsv4_ort.models`` (PyTorch reference and checkpoint I/O), ``dsv4_ort.export`` (checkpoint -> ONNX),
``dsv4_ort.runtime`` (sessions, state, generation). The custom-op library implementing the ``ai.dsv4ort`` domain
ships inside the package: :func:`get_library_path`, :func:`register`.
"""

from ._library import get_library_path, isa_cap, library_info, register

__version__ = "0.1.0"
ISA_LEVELS = ("scalar", "avx2", "avx512", "amx")

__all__ = ["get_library_path", "register", "library_info", "isa_cap", "ISA_LEVELS", "__version__"]
