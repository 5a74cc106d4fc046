"""Tools around the step-time cost model (``engine.costmodel``): ``chunkserve profile`` and
``tune`` (``profiler``), ``chunkserve simulate`` (``simulate``: the real scheduler and budget
driven by a cost model), and their command line (``cli``)."""
