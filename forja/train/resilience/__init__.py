"""What keeps a run going (health, recovery, the hang watchdog) and what it records of its
failures (drills, stragglers, goodput)."""
