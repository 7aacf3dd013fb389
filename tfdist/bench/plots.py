"""The PNG plots benchmarks write with `--plot`: one size and style, drawn off-screen."""

from __future__ import annotations

import contextlib
from typing import Iterator

__all__ = ["png"]


@contextlib.contextmanager
def png(path: str) -> Iterator[tuple]:
    """Yields (figure, axes) to draw on; on leaving, adds the grid and legend and saves the figure
    as PNG at `path`."""
    from tfdist._compat.optional import pyplot

    plt = pyplot()

    figure, axes = plt.subplots(figsize=(6, 4.5), dpi=100)
    try:
        yield figure, axes
        axes.grid(True, alpha=0.3)
        axes.legend()
        figure.tight_layout()
        figure.savefig(path)
    finally:
        plt.close(figure)
