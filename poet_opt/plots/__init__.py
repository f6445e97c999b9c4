"""Plots: a schedule's RAM over its steps, and a sweep's energy-memory front."""

from poet_opt.plots.front import plot_front
from poet_opt.plots.timeline import plot_timeline, timeline

__all__ = ["plot_front", "plot_timeline", "timeline"]
