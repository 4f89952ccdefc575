"""The real Inkling as published: its config, its checkpoint layout and synthetic checkpoints in that layout.

transformers 5.23.0 (`transformers/models/inkling/`) is the numerical truth for the main model
(../shared/INKLING_SPEC.md); INKLING_SERVING.md gives what it does not define (MTP, the NVFP4 files).
"""
