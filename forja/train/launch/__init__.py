"""What happens before the loop: the `forja train` command, its preflight, the run directory."""
