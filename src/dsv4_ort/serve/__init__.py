"""An OpenAI-compatible HTTP server over the continuous-batching engine (:mod:`dsv4_ort.runtime.engine`).

Needs the ``serve`` extra (``pip install 'dsv4-ort[serve]'``: starlette and uvicorn); importing this package
without it raises ImportError naming the extra. Run it with ``dsv4-ort serve MODEL_DIR``.
"""

from __future__ import annotations

try:
    import starlette  # noqa: F401
    import uvicorn  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the installation
    raise ImportError(f"dsv4_ort.serve needs the serve extra ({e}); pip install 'dsv4-ort[serve]'") from e

from .app import build_app  # noqa: E402
from .server import run  # noqa: E402

__all__ = ["build_app", "run"]
