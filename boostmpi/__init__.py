"""boostmpi: training low-rank bottleneck language models with bottleneck-aware 3D parallelism."""

__version__ = "0.1.0"
