"""What happens before the loop: nothing here trains the model. Its floors, lowest first:

    run_store.py, stage_history.py, data.py  run.dir on an object store; begun stages; the run's data and loaders
    run_dir.py                               the run directory: checked without writing, then prepared
    preflight.py, finished.py, ft_groups.py  every check that can fail a launch; a finished rerun; --ft-groups
    agent.py                                 --nproc: torchrun's agent in the launcher, workers from a fork server
"""
