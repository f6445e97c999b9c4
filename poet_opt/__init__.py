"""poet-opt: energy-optimal rematerialization and paging schedules for on-device training."""

__version__ = "0.1.0"
