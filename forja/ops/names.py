"""The names of forja's fused ops (light: no torch or triton import), for configs."""

FUSED_OPS = ("rms_norm", "rope", "swiglu", "cross_entropy")
