"""Plots: a schedule's RAM over its steps, and a sweep's energy-memory front."""

from poet_opt.plots.front import front_figure, plot_front
from poet_opt.plots.timeline import plot_timeline, timeline, timeline_figure

__all__ = ["front_figure", "plot_front", "plot_timeline", "timeline", "timeline_figure"]
