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


def binary_ticks(vmin: float, vmax: float, nbins: int = 8) -> list[float]:
    """Tick positions in bytes at round numbers of the binary unit (KiB, MiB, ...) of the range's top:
    1 MiB, 1.5 MiB, 2 MiB rather than 1 MB shown as '977 KiB'."""
    from matplotlib.ticker import MaxNLocator

    top = max(abs(vmin), abs(vmax), 1.0)
    unit = 1024.0 ** max(0, min(4, int(math.log(top, 1024))))
    return [t * unit for t in MaxNLocator(nbins=nbins, steps=[1, 2, 2.5, 5, 10]).tick_values(vmin / unit, vmax / unit)]


def bytes_axis(ax, axis: str = "x") -> None:
    """Label a byte axis in binary units (KiB, MiB), with ticks at round values of that unit."""
    from matplotlib.ticker import FuncFormatter, Locator

    class _Binary(Locator):
        def __call__(self):
            return self.tick_values(*self.axis.get_view_interval())

        def tick_values(self, vmin, vmax):
            return binary_ticks(vmin, vmax)

    target = ax.xaxis if axis == "x" else ax.yaxis
    target.set_major_locator(_Binary())
    target.set_major_formatter(FuncFormatter(lambda v, _pos: format_bytes(v, binary=True) if v > 0 else "0"))


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


def size_text(n: float) -> str:
    """A size as the plots print it: binary units (1.5 MiB, 512 KiB), like their axes."""
    return format_bytes(n, binary=True)
