"""A run rehearsed on fake devices: forja's real build and one real step, at full size and full
world size, in one CPU process, with every allocation and collective accounted.

    run.py          one rank position: the fake world, the build, the step, the staging
    tracker.py      live bytes by category and their peak (a dispatch mode over fake tensors)
    collectives.py  every collective of the step by kind and group
    routing.py      experts routed as a balanced router would: fake tensors hold no router values
    kernels.py      latent attention on the kernel a GPU takes, not the CPU's math fallback
"""
