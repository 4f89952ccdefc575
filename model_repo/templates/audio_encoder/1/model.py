"""audio_encoder: the engine's audio program (model_repo/encoder.py)."""

from model_repo.encoder import EncoderModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
