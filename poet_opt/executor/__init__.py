"""Run a schedule in PyTorch (``ScheduleExecutor``, `poet-opt run`) and measure per-node costs on this machine
(`poet-opt measure`)."""
