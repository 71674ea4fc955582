"""zhflow's ML library: plain Python and PyTorch, no orchestrator."""

__version__ = "0.1.0"
