"""forja: PyTorch-native pre-training of large language models.

One small codebase that trains the same config on a laptop CPU, one GPU or many
(through `torchrun`). The map of the package is in docs/architecture.md.
"""

__version__ = "0.1.0"
