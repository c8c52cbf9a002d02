"""How to cut: pruning methods, units, importance criteria, schedules and accounting."""
