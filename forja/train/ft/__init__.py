"""Fault-tolerant replica groups (torchft): see forja/train/ft/replicas.py."""
