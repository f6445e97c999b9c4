"""Schedule stage: a plan as budgets and decisions, the ordered steps it replays as, the schedule
document written to JSON, the independent validator that replays it, and its summaries."""
