"""matplotlib for the benchmark figures, imported only when a figure is asked for."""

from __future__ import annotations


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (no display needed)."""
    try:
        import matplotlib
    except ImportError as e:
        raise ValueError("figures need matplotlib: pip install matplotlib") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
