"""dsv4-ort benchmark suite: machine limits, kernels on the roofline, the model end to end, baselines.

Run it with ``dsv4-ort bench`` (or ``python -m dsv4_ort.bench``); see :mod:`.cli` for the options. Modules:

* :mod:`.machine` - DRAM bandwidth and peak arithmetic (the native ``libdsv4_roofline`` probes), machine description,
  interference meter;
* :mod:`.timing` - repeated timing with medians and spread;
* :mod:`.ortgraph` - N-copy one-op graphs fed from a rotating data pool (weights stay colder than the LLC);
* :mod:`.cases` - every op family at DeepSeek-V4 shapes with its cost model;
* :mod:`.kernels`, :mod:`.baselines` - the kernel runs per ISA level and the PyTorch / onnxruntime baselines;
* :mod:`.e2e` - the bench preset end to end, bytes per decoded token, PyTorch reference and transformers;
* :mod:`.report`, :mod:`.plots`, :mod:`.readme` - results.json schema, summary.md, charts, the README section.

The standalone scripts ``bench_linear.py`` / ``bench_attention.py`` in this directory are independent tools.
"""

from .suite import MODES, SCHEMA, run

__all__ = ["run", "MODES", "SCHEMA"]
