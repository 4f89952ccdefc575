"""The Triton model repository and its launcher (DESIGN.md "Serving").

templates/<model>/config.pbtxt + 1/model.py: preprocessing -> image_encoder, audio_encoder -> inkling
(the runtime's engine loop, decoupled), tied by `ensemble` (BLS, decoupled, streams) and
`ensemble_unary` (BLS, its non-decoupled twin). `serve.py` fills the templates and runs the
tritonserver binary of the nvidia-pytriton wheel; `tensors.py` holds the models' shared helpers.
"""
