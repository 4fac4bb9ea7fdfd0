"""Training: the loop and what it stands on (docs/training.md).

Its floors, lowest first; each imports only those below it (tests/unit/test_layering.py):

    config.py      [run], [train], [debug] (debug.inject's drill grammar, checked at load)
    step/          how one step runs: the step engine and the bookkeeping it carries; beside it,
                   build.py (the one build order of a model)
    resilience/    what keeps a run going (health, recovery, the watchdog, drills) and what it measures of it
    ft/            fault-tolerant replica groups on torchft ([ft]): one group's manager, DiLoCo, the lighthouse
    rehearse/      a run's build and one step at full size and world size on fake devices
    launch/        what happens before the loop: the preflight, the run directory, the run's data, ft groups
    trainer.py     the loop, beside what only it uses: callbacks.py, evaluation.py (the in-loop
                   [eval]), probes.py (activation sizes)
    cli.py         `forja train`: the preflight, then one process, a torchrun launch or replica groups
"""
