"""Fault-tolerant replica groups on torchft ([ft]): groups that die are left behind and heal.
Its floors, lowest first (the launch of G groups is forja/train/launch/ft_groups.py):

    config.py, checks.py, lighthouse.py  [ft]; what it refuses before any step; `python -m forja.train.ft.lighthouse`
    diloco.py                            DiLoCo / Streaming DiLoCo's outer loop
    replicas.py                          one group's torchft manager: quorum, averaged gradients, commit, heal
"""
