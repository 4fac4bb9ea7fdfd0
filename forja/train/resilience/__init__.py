"""What keeps a run going and what it records of its failures. Its floors, lowest first:

    health.py, watchdog.py, fingerprint.py  non-finite values and spikes; hangs; replicas' weights compared
    stragglers.py, goodput.py               who makes the others wait; productive time over wall time
    drills.py, recovery.py                  faults on purpose (debug.inject); the loop's one call per step
"""
