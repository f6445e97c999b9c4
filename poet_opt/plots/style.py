"""What every plot shares: a headless backend, byte and energy axes, and PNG/SVG output."""

from __future__ import annotations

import math
from pathlib import Path

from poet_opt.files import write_atomic
from poet_opt.units import format_bytes


def pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def bytes_axis(ax, axis: str = "x") -> None:
    from matplotlib.ticker import FuncFormatter

    fmt = FuncFormatter(lambda v, _pos: format_bytes(v) if v > 0 else "0")
    (ax.xaxis if axis == "x" else ax.yaxis).set_major_formatter(fmt)


def energy_unit(values) -> tuple[float, str]:
    top = max((abs(v) for v in values if v is not None and math.isfinite(v)), default=1.0)
    for scale, unit in ((1.0, "J"), (1e-3, "mJ"), (1e-6, "uJ")):
        if top >= scale:
            return scale, unit
    return 1e-6, "uJ"


def save_figure(fig, path) -> list[Path]:
    """Write PNG at ``path`` (any other suffix: PNG and SVG side by side under its stem)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() == ".svg":
        targets = [path, path.with_suffix(".png")]
    elif path.suffix.lower() == ".png":
        targets = [path]
    else:
        targets = [path.with_suffix(".png"), path.with_suffix(".svg")]
    for target in targets:
        write_atomic(target, lambda fh: fig.savefig(fh, format=target.suffix[1:].lower(), dpi=150,
                                                    bbox_inches="tight"), field="-o", binary=True)
    return targets
