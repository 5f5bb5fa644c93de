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
"""

__all__ = ["run", "MODES", "SCHEMA"]


def __getattr__(name):
    # The suite (numpy, onnxruntime) loads on first use, not when the dsv4-ort parser imports .cli: the bench sets
    # up the process (cli.quiet_numpy_blas) before numpy loads.
    if name in __all__:
        from . import suite

        return getattr(suite, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
