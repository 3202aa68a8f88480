"""The algorithm's math, pure: the method registry (registry.py), the losses and advantage rules (losses.py), the
adaptive controllers' state transitions (controllers.py). docs/methods.md."""
